"""The one piece of the two-instance scenario that vLLM does not have: a tiny HTTP forwarder
that sends each request of vLLM's client to the instance the dataset chose for it.

vLLM 0.32's `vllm bench serve` talks to one base URL, and running it twice (one client per
instance) cannot keep a conversation's turns in order across instances: two independent arrival
processes may send turn k+1 to one server before turn k has finished on the other. So the bench
runs one client against this forwarder on a free loopback port; the client stamps every request
with `x-request-id: <prefix><row>` (its ShareGPT loader numbers the file's rows), and the
forwarder looks the row up in the routes the dataset made (`datasets.alternating_instances`).
A request without such an id (the client's look at /metrics) goes to instance 0.

Standard library only (a thread per connection, as the client holds one keep-alive connection
per request in flight). Responses are relayed as they arrive, chunk by chunk, flushed at once,
so streamed tokens reach the client when the server sends them: TTFT and ITL include one
loopback hop more than with a direct connection, for every system of the scenario alike.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

HOST = "127.0.0.1"
UPSTREAM_TIMEOUT_S = 3600.0  # a request may wait long in a loaded server's queue
# Headers about one connection, not the message: never relayed.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding",
                         "te", "trailer", "upgrade", "content-length", "host"})


def route_of(request_id: str | None, prefix: str, routes: Sequence[int]) -> int:
    """The instance of a request id `<prefix><row>`: routes[row]; 0 for any other id."""
    if request_id is None or not request_id.startswith(prefix):
        return 0
    row = request_id[len(prefix):]
    if not row.isdigit() or int(row) >= len(routes):
        return 0
    return routes[int(row)]


class _ForwardingServer(ThreadingHTTPServer):
    daemon_threads = True  # a connection the client left open does not hold the bench
    forwarder: Forwarder


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's aiohttp client expects
    server: _ForwardingServer

    def do_GET(self) -> None:  # http.server's naming
        self._forward()

    def do_POST(self) -> None:
        self._forward()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request on stderr would drown the bench's output

    def _forward(self) -> None:
        forwarder = self.server.forwarder
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        target = forwarder.pick(self.headers.get("x-request-id"))
        upstream = http.client.HTTPConnection(HOST, forwarder.ports[target],
                                              timeout=UPSTREAM_TIMEOUT_S)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            upstream.request(self.command, self.path, body=body, headers=headers)
            reply = upstream.getresponse()
        except OSError as exc:
            upstream.close()
            self.send_error(502, f"instance {target}: {exc}")
            return
        try:
            self.send_response(reply.status, reply.reason)
            for key, value in reply.getheaders():
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while data := reply.read1(65536):  # what has arrived, without waiting for more
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        finally:
            upstream.close()


class Forwarder:
    """Listens on a free loopback port (`url`) and forwards each request to the loopback port
    `ports[route_of(its x-request-id)]`; `counts` says how many went to each. `close()` stops
    it; use as a context manager."""

    def __init__(self, ports: Sequence[int], routes: Sequence[int], id_prefix: str) -> None:
        if any(r not in range(len(ports)) for r in routes):
            raise ValueError(f"routes name instances outside 0..{len(ports) - 1}")
        self.ports = list(ports)
        self.routes = list(routes)
        self.id_prefix = id_prefix
        self.counts = [0] * len(ports)
        self._lock = threading.Lock()
        self._server = _ForwardingServer((HOST, 0), _Handler)
        self._server.forwarder = self
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1}, daemon=True,
                                        name="kvport-serve-forwarder")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._server.server_address[1]}"

    def pick(self, request_id: str | None) -> int:
        target = route_of(request_id, self.id_prefix, self.routes)
        if request_id is not None and request_id.startswith(self.id_prefix):
            with self._lock:  # count the client's requests only, not its /metrics look
                self.counts[target] += 1
        return target

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
