"""The one piece of the two-instance scenario that vLLM does not have: a tiny HTTP forwarder
that sends each request of vLLM's client to the instance the dataset chose for it.

vLLM 0.32's `vllm bench serve` talks to one base URL, and running it twice (one client per
instance) cannot keep a conversation's turns in order across instances: two independent arrival
processes may send turn k+1 to one server before turn k has finished on the other. So the bench
runs one client against this forwarder on a free loopback port; the client stamps every request
with `x-request-id: <prefix><row>` (its ShareGPT loader numbers the file's rows), and the
forwarder looks the row up in the routes the dataset made (`datasets.alternating_instances`).
A request without such an id (the client's look at /metrics) goes to instance 0.

The prefill-decode scenario uses it as the router of a disaggregated pair: with `prefill` set,
each of the client's requests is first sent to that instance as the same request asking for one
token, not streamed; once its answer is complete (a kv_producer answers after its KV is written
through, so the decode instance finds it) the request goes to the instance of its row, whose
stream the client gets. A failed prefill is the client's answer, as is.

Standard library only (a thread per connection, as the client holds one keep-alive connection
per request in flight). Responses are relayed as they arrive, chunk by chunk, flushed at once,
so streamed tokens reach the client when the server sends them: TTFT and ITL include one
loopback hop more than with a direct connection, for every system of the scenario alike.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
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
        request_id = self.headers.get("x-request-id")
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if (forwarder.prefill is not None and forwarder.is_client_request(request_id) and body
                and not self._prefill(forwarder, body, headers)):
            return  # the prefill failed: the client has its answer
        target = forwarder.pick(request_id)
        upstream = http.client.HTTPConnection(HOST, forwarder.ports[target],
                                              timeout=UPSTREAM_TIMEOUT_S)
        try:
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


    def _prefill(self, forwarder: Forwarder, body: bytes, headers: dict[str, str]) -> bool:
        """Send the request to the prefill instance for one token and wait for the whole
        answer; False (the client got that answer) if it failed."""
        assert forwarder.prefill is not None, "a prefill without its instance"
        try:
            ask = json.loads(body)
        except ValueError:
            return True  # not a generation request: nothing to prefill
        if not isinstance(ask, dict):
            return True
        ask.update(max_tokens=1, stream=False)
        ask.pop("stream_options", None)
        start = time.monotonic()
        upstream = http.client.HTTPConnection(HOST, forwarder.ports[forwarder.prefill],
                                              timeout=UPSTREAM_TIMEOUT_S)
        try:
            upstream.request("POST", self.path, body=json.dumps(ask).encode(),
                             headers={**headers, "Content-Type": "application/json"})
            reply = upstream.getresponse()
            answer = reply.read()
        except OSError as exc:
            self.send_error(502, f"prefill instance: {exc}")
            return False
        finally:
            upstream.close()
        forwarder.add_prefill(forwarder.prefill, time.monotonic() - start)
        if reply.status == 200:
            return True
        self.send_response(reply.status, reply.reason)
        self.send_header("Content-Type", reply.getheader("Content-Type") or "text/plain")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
        return False


class Forwarder:
    """Listens on a free loopback port (`url`) and forwards each request to the loopback port
    `ports[route_of(its x-request-id)]`, after a one-token prefill on `ports[prefill]` if
    `prefill` is set; `counts` says how many went to each (prefills too), `prefill_s` how long
    each prefill took. `close()` stops it; use as a context manager."""

    def __init__(self, ports: Sequence[int], routes: Sequence[int], id_prefix: str,
                 prefill: int | None = None) -> None:
        if any(r not in range(len(ports)) for r in routes):
            raise ValueError(f"routes name instances outside 0..{len(ports) - 1}")
        if prefill is not None and prefill not in range(len(ports)):
            raise ValueError(f"prefill names instance {prefill}, outside 0..{len(ports) - 1}")
        self.ports = list(ports)
        self.routes = list(routes)
        self.id_prefix = id_prefix
        self.prefill = prefill
        self.counts = [0] * len(ports)
        self.prefill_s: list[float] = []
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

    def is_client_request(self, request_id: str | None) -> bool:
        """One of the dataset's requests (not the client's look at /metrics)."""
        return request_id is not None and request_id.startswith(self.id_prefix)

    def pick(self, request_id: str | None) -> int:
        target = route_of(request_id, self.id_prefix, self.routes)
        if self.is_client_request(request_id):
            with self._lock:  # count the client's requests only
                self.counts[target] += 1
        return target

    def add_prefill(self, instance: int, seconds: float) -> None:
        with self._lock:
            self.counts[instance] += 1
            self.prefill_s.append(seconds)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
