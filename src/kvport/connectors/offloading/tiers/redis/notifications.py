"""Redis's own removals of the tier's values, as they happen (`keyspace_events`).

Redis evicts values under `maxmemory`, expires them, and other instances (or an operator) delete
them. kvport otherwise learns of such a removal only when a lookup or a load finds the value gone,
so a router reading KV events would keep routing to an instance for a prefix Redis no longer
holds. With the server's keyevent notifications on (`notify-keyspace-events` with E for keyevent
channels, e for evicted, x for expired, g for del), a thread of the scheduler's process subscribes
to `__keyevent@<db>__:evicted`, `:expired` and `:del`, keeps the keys under this tier's own
prefix, and hands them to the same sink as a lookup's "not there" answers (`DroppedKeys`): the
scheduler half announces each as removed at its next `take_events`.

Notifications are fire-and-forget (Pub/Sub): a removal while the subscriber is disconnected is
not announced by it (the next lookup that finds the value gone still is). The subscriber
reconnects with a doubling backoff and never raises into the engine. At connect, it reads the
server's `notify-keyspace-events` and warns once if the flags it needs are missing (setting them
is the operator's call, as are the rest of Redis's settings); a server that refuses CONFIG
(an ACL) is not an error.
"""

from __future__ import annotations

import logging
import threading

import redis

from kvport.connectors.offloading.tiers import DroppedKeys
from kvport.connectors.offloading.tiers.redis.client import RedisConnection, RedisKeyspace

logger = logging.getLogger(__name__)

EVENTS = (b"evicted", b"expired", b"del")
NEEDED_FLAGS = {"E": "keyevent channels", "e": "evicted", "x": "expired", "g": "del"}
POLL_S = 0.2  # a read waits this long for a message, so close() is seen as soon
BACKOFF_START_S, BACKOFF_CAP_S = 0.2, 10.0


def missing_flags(setting: str) -> list[str]:
    """The flags of `notify-keyspace-events` that the subscriber needs and `setting` lacks
    (A stands for every event class but the m and n ones)."""
    have = set(setting)
    if "A" in have:
        have |= set("g$lshzxetd")
    return [flag for flag in NEEDED_FLAGS if flag not in have]


class RemovalListener:
    """The subscriber thread: started at construction, ended by `close()`. `num_removals`:
    keys of this tier it reported; `connected`: subscribed now."""

    def __init__(self, conn: RedisConnection, keyspace: RedisKeyspace, sink: DroppedKeys) -> None:
        self._conn = conn
        self._prefix = keyspace.prefix
        self._sink = sink
        self._channels = [b"__keyevent@%d__:%s" % (conn.db, e) for e in EVENTS]
        self._stop = threading.Event()
        self._warned = False
        self.num_removals = 0
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvport-redis-removals",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = BACKOFF_START_S
        while not self._stop.is_set():
            try:
                self._listen()
                return
            except (redis.RedisError, OSError) as exc:
                self.connected.clear()
                logger.warning("Redis tier: %s: keyspace notifications lost (%s); resubscribing "
                               "in %.1f s", self._conn.url, type(exc).__name__, backoff)
                self._stop.wait(backoff)
                backoff = min(BACKOFF_CAP_S, 2 * backoff)

    def _listen(self) -> None:
        client = self._conn.single_client(POLL_S * 10)
        try:
            self._check_server(client)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(*self._channels)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=POLL_S)
                    if message is None:
                        self.connected.set()  # subscribed, and no message pending
                        continue
                    if message.get("type") == "message":
                        self._removed(message.get("data"))
            finally:
                pubsub.close()
        finally:
            client.close()

    def _check_server(self, client: redis.Redis) -> None:
        """Warn once if the server does not publish the events this listens for."""
        if self._warned:
            return
        try:
            setting = client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
        except redis.ResponseError:  # CONFIG not allowed: the operator knows the setting
            return
        missing = missing_flags(str(setting))
        if missing:
            self._warned = True
            logger.warning("Redis tier: %s publishes no %s notifications "
                           "(notify-keyspace-events is %r; add %s): its removals are announced "
                           "only when a lookup finds them gone", self._conn.url,
                           ", ".join(NEEDED_FLAGS[f] for f in missing), setting, "".join(missing))

    def _removed(self, data: object) -> None:
        if not isinstance(data, bytes) or not data.startswith(self._prefix):
            return  # another tenant's, another namespace's, or not kvport's at all
        try:
            key = bytes.fromhex(data[len(self._prefix):].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return  # under the prefix but not a key this tier writes
        self._sink.add([key])
        self.num_removals += 1

    def close(self) -> None:
        """Stop the thread (it sees the stop within POLL_S); never raises."""
        self._stop.set()
        self._thread.join(timeout=10 * POLL_S)
