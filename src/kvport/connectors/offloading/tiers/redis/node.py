"""One Redis server as the Redis tier reaches it: a connection pool, a down state, and batches of
one-key commands sent as one pipeline with a deadline for the whole round trip.

Deadline: a socket timeout bounds each socket operation, not a reply that trickles in a byte at a
time, nor a connect followed by a slow reply. So every batch arms the `Watchdog` (one thread for
the process) with its deadline; at the deadline the watchdog shuts the batch's socket down, the
blocked read fails at once, and the batch fails as a timeout. The connection is then dropped (a
half-read reply must never be read by the next batch).

Down state (`Health`): a connection error or timeout marks the server down for a backoff (0.2 s,
doubling up to 5 s). While down, batches fail at once without touching the network; once the
backoff elapsed one batch probes (others still skip), and its success ends the down state.
Without it every scheduler step would wait out a timeout while the server is gone.

No method here raises for a Redis problem but `call`, whose caller (redis_client) turns the
exception into failed positions: `REDIS_FAILURES` lists what a server, a network or redis-py may
raise for one.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, ResponseError
from redis.retry import Retry

logger = logging.getLogger(__name__)

BACKOFF_START_S = 0.2
BACKOFF_CAP_S = 5.0
ACTION_WAIT_S = 1.0  # a fired alarm's action (a socket shutdown) ends within microseconds
# What a server, the network or redis-py raise for a Redis problem (never a bug of ours): a
# cluster client's own family (RedisClusterException) does not derive from RedisError.
REDIS_FAILURES = (redis.RedisError, RedisClusterException, OSError, EOFError)

Command = tuple[Any, ...]  # (name, key, *args): every command names one key (or none: ASKING)


class DeadlineExceeded(redis.TimeoutError):
    """A batch's whole round trip outlasted its deadline (the watchdog cut it off)."""


class _Alarm:
    __slots__ = ("deadline", "action", "state", "acted")

    def __init__(self, deadline: float, action: Callable[[], None]) -> None:
        self.deadline = deadline
        self.action = action
        self.state = "armed"  # -> "disarmed" or "fired", under the watchdog's lock
        self.acted = threading.Event()  # set once a fired alarm's action has returned


class Watchdog:
    """Runs an action at its deadline unless it was disarmed first; one thread for all alarms.
    Disarming is cheap (no wake-up): the thread pops disarmed alarms when their time comes."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Alarm]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, action: Callable[[], None]) -> _Alarm:
        alarm = _Alarm(deadline, action)
        with self._cond:
            earliest = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, next(self._seq), alarm))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvport-redis-watchdog",
                                                daemon=True)
                self._thread.start()
            elif earliest:
                self._cond.notify()
        return alarm

    def disarm(self, alarm: _Alarm) -> bool:
        """True if the alarm had not fired (it never will now)."""
        with self._cond:
            if alarm.state == "armed":
                alarm.state = "disarmed"
            return alarm.state == "disarmed"

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                deadline, _, alarm = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                if alarm.state != "armed":
                    continue
                alarm.state = "fired"
            try:
                alarm.action()
            except Exception:  # an action that fails must not end the watchdog
                logger.debug("watchdog action failed", exc_info=True)
            finally:
                alarm.acted.set()


WATCHDOG = Watchdog()


class Health:
    """The down state of one server (or of a cluster's slot map): module docstring."""

    def __init__(self, name: str) -> None:
        self.name = name  # redacted: for log lines
        self._lock = threading.Lock()
        self._failures = 0  # consecutive failed attempts; > 0: down
        self._down_until = 0.0  # time.monotonic() before which attempts are skipped
        self._probing = False  # one attempt is under way while down

    def admit(self) -> str | None:
        """None: skip (down); "probe": the one attempt after a backoff; "call": up."""
        with self._lock:
            if self._failures == 0:
                return "call"
            if self._probing or time.monotonic() < self._down_until:
                return None
            self._probing = True
            return "probe"

    def done(self, admitted: str | None) -> None:
        """The attempt `admit` allowed has ended (whatever its outcome)."""
        if admitted == "probe":
            with self._lock:
                self._probing = False

    def up(self) -> None:
        with self._lock:
            recovered = self._failures > 0
            self._failures = 0
        if recovered:
            logger.info("Redis tier: %s reachable again", self.name)

    def down(self, why: str) -> float:
        """Count a failed attempt; the backoff until the next one (logged once per outage)."""
        with self._lock:
            self._failures += 1
            backoff = min(BACKOFF_CAP_S, BACKOFF_START_S * 2 ** (self._failures - 1))
            self._down_until = time.monotonic() + backoff
            first = self._failures == 1
        (logger.warning if first else logger.debug)(
            "Redis tier: %s unavailable (%s); next attempt in %.1f s", self.name, why, backoff)
        return backoff

    @property
    def is_down(self) -> bool:
        with self._lock:
            return self._failures > 0


class RedisNode:
    """One server, reached through `pool` (a redis-py ConnectionPool: its connections carry the
    credentials, the TLS settings and the socket timeouts)."""

    def __init__(self, name: str, pool: redis.ConnectionPool) -> None:
        self.name = name  # host:port
        self.pool = pool
        self.health = Health(name)

    def call(self, commands: Sequence[Command], deadline: float) -> list[Any]:
        """Send the commands as one pipeline and read every reply before `deadline`
        (time.monotonic()): each position holds its reply or its error reply (a ResponseError).
        Raises one of REDIS_FAILURES if the round trip failed (DeadlineExceeded: too late)."""
        conn = _get_connection(self.pool)
        alarm = WATCHDOG.arm(deadline, lambda: _shut_down(conn))  # the blocked read fails
        clean = False
        try:
            conn.send_packed_command(conn.pack_commands(list(commands)))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:  # this command's error reply; the rest follow
                    replies.append(exc)
            clean = True
            return replies  # whole, even if the watchdog fired after the last reply
        except Exception as exc:  # noqa: BLE001 - a cut-off read may fail in any way
            if not WATCHDOG.disarm(alarm):  # it fired: the read failed because it was cut off
                raise DeadlineExceeded(f"no whole reply from {self.name} within the "
                                       f"deadline") from exc
            raise
        finally:
            fired = not WATCHDOG.disarm(alarm)
            if fired:  # its disconnect must be over before another batch takes the connection
                alarm.acted.wait(ACTION_WAIT_S)
            if fired or not clean:
                conn.disconnect()  # never leave a half-read reply for the next batch
            self.pool.release(conn)

    def close(self) -> None:
        self.pool.disconnect(inuse_connections=True)


def node_pool(base: redis.ConnectionPool, host: str, port: int) -> redis.ConnectionPool:
    """A pool like `base` (credentials, TLS, timeouts) for another server of a cluster."""
    kwargs = {**base.connection_kwargs, "host": host, "port": port, "db": 0}
    return redis.ConnectionPool(connection_class=base.connection_class, **kwargs)


def url_pool(url: str, username: str | None, password: str | None, timeout_s: float,
             tls_ca_file: str | None) -> redis.ConnectionPool:
    """The pool for a URL without credentials (they come separately, so no message shows them).
    redis-py's retries are off: a failure is reported at once; the down state paces retries."""
    kw: dict[str, Any] = {"username": username, "password": password,
                          "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                          "retry": Retry(NoBackoff(), 0)}
    if url.startswith("rediss://"):
        kw["ssl_cert_reqs"] = "required"
        kw["ssl_check_hostname"] = True  # explicit: redis-py's default changed across releases
        if tls_ca_file:
            kw["ssl_ca_certs"] = tls_ca_file
    return redis.ConnectionPool.from_url(url, **kw)


def _shut_down(conn: Any) -> None:
    """End the connection's socket for both directions, from another thread: a read blocked on
    it returns at once (end of stream), and the reading thread then disconnects it itself (so
    redis-py's buffers are closed by the thread that uses them)."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


def _get_connection(pool: redis.ConnectionPool) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py 5 wants a command name (unused)
        return pool.get_connection("PIPELINE")
