"""A loopback TCP proxy with faults, put between the Redis tier and a real redis-server.

`FaultProxy(target_port).start()` listens on a free 127.0.0.1 port (`url`) and relays each
accepted connection to 127.0.0.1:target_port, one reader and one writer thread per direction.
Faults (`set(...)`, any time; `clear()`), applied to what the server sends back ("down") unless
said otherwise:

    latency_s      every chunk is delivered latency_s after it arrived (both directions)
    rate_bps       bytes per second, delivered in 10 ms slices
    trickle_s      the reply trickles: one byte, then trickle_s, then the next
    half_open      nothing is relayed either way and nothing is closed (a peer that vanished
                   without a FIN or RST); new connections are accepted and left silent
    min_bytes      the faults above hit only chunks of at least this many bytes (the GET replies
                   of large values, not the EXISTS replies of the lookups)

`reset_after(n, direction)`: one shot; once n more bytes went that way on one connection, the
rest of the chunk is dropped and both sides are reset (RST, not FIN): a reset in the middle of a
pipeline. Counted: `connections` (accepted), `resets` (injected). Only 127.0.0.1 is reached.
"""

from __future__ import annotations

import queue
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

HOST = "127.0.0.1"
CHUNK = 65536
SLICE_S = 0.01  # the throttle's pacing
POLL_S = 0.02  # a reader looks at its link's state this often


@dataclass(frozen=True)
class Faults:
    latency_s: float = 0.0
    rate_bps: float | None = None
    trickle_s: float | None = None
    half_open: bool = False
    min_bytes: int = 0


@dataclass
class _Reset:
    left: int
    direction: str


@dataclass
class _Link:
    client: socket.socket
    server: socket.socket
    closed: threading.Event = field(default_factory=threading.Event)

    def reset(self) -> None:
        """Both sockets closed with an RST (SO_LINGER 0)."""
        for sock in (self.client, self.server):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        self.closed.set()
        for sock in (self.client, self.server):
            try:
                sock.close()
            except OSError:
                pass


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target = (HOST, target_port)
        self._listener = socket.create_server((HOST, 0))
        self.port = int(self._listener.getsockname()[1])
        self._faults = Faults()
        self._reset: _Reset | None = None
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._stopped = threading.Event()
        self.connections = 0
        self.resets = 0

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    # --- control --------------------------------------------------------------------------------

    def set(self, **faults: Any) -> None:
        with self._lock:
            self._faults = replace(self._faults, **faults)

    def clear(self) -> None:
        with self._lock:
            self._faults = Faults()
            self._reset = None

    def reset_after(self, n: int, direction: str = "down") -> None:
        assert direction in ("up", "down"), direction
        with self._lock:
            self._reset = _Reset(n, direction)

    @property
    def faults(self) -> Faults:
        with self._lock:
            return self._faults

    def start(self) -> FaultProxy:
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()

    def close_all(self) -> None:
        """Close every relayed connection (FIN), as a restarted proxy or server would."""
        with self._lock:
            links, self._links = list(self._links), []
        for link in links:
            link.close()

    # --- relaying -------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5.0)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            link = _Link(client, server)
            with self._lock:
                self.connections += 1
                self._links.append(link)
            for src, dst, direction in ((client, server, "up"), (server, client, "down")):
                chunks: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()
                threading.Thread(target=self._read, args=(link, src, chunks),
                                 name=f"proxy-read-{direction}", daemon=True).start()
                threading.Thread(target=self._write, args=(link, dst, chunks, direction),
                                 name=f"proxy-write-{direction}", daemon=True).start()

    def _read(self, link: _Link, src: socket.socket,
              chunks: queue.SimpleQueue[tuple[float, bytes] | None]) -> None:
        # Never blocked in recv for long: a socket another thread closes with an RST is only
        # released (and the RST only sent) once no call is using it.
        try:
            while not link.closed.is_set():
                if not select.select([src], [], [], POLL_S)[0]:
                    continue
                data = src.recv(CHUNK)
                if not data:
                    break
                chunks.put((time.monotonic(), data))
        except (OSError, ValueError):  # closed under us
            pass
        chunks.put(None)

    def _write(self, link: _Link, dst: socket.socket,
               chunks: queue.SimpleQueue[tuple[float, bytes] | None], direction: str) -> None:
        try:
            while True:
                item = chunks.get()
                if item is None or link.closed.is_set():
                    break
                arrived, data = item
                faults = self.faults
                hit = len(data) >= faults.min_bytes
                if faults.half_open and hit:
                    continue  # swallowed: the peer never hears of it
                if hit and faults.latency_s:
                    self._pause(arrived + faults.latency_s - time.monotonic(), link)
                if not self._send(link, dst, data, direction, faults if hit else Faults()):
                    break
        except OSError:
            pass
        if not link.closed.is_set():
            link.close()  # one side ended: end the other (a FIN each way)

    def _send(self, link: _Link, dst: socket.socket, data: bytes, direction: str,
              faults: Faults) -> bool:
        with self._lock:
            reset = self._reset
            if reset is not None and reset.direction == direction:
                if len(data) > reset.left:
                    data, cut = data[:reset.left], True
                    self._reset = None
                    self.resets += 1
                else:
                    reset.left -= len(data)
                    cut = False
            else:
                cut = False
        if direction == "down" and faults.trickle_s is not None:
            for i in range(len(data)):
                dst.sendall(data[i:i + 1])
                if not self._pause(faults.trickle_s, link):
                    return False
        elif direction == "down" and faults.rate_bps is not None:
            step = max(1, int(faults.rate_bps * SLICE_S))
            for i in range(0, len(data), step):
                dst.sendall(data[i:i + step])
                if not self._pause(SLICE_S, link):
                    return False
        else:
            dst.sendall(data)
        if cut:
            link.reset()
            return False
        return True

    def _pause(self, seconds: float, link: _Link) -> bool:
        """Wait (a fault's delay, not a test waiting); False once the link or proxy closed."""
        if seconds > 0:
            link.closed.wait(seconds)
        return not (link.closed.is_set() or self._stopped.is_set())
