"""The Redis tier's view of a Redis Cluster: which server holds each of the 16384 hash slots.

kvport keeps its own slot map rather than use redis-py's cluster client: that client raises its
own exception family when no startup node answers, rebuilds itself on each MOVED, and resends
failed commands one by one, each waiting out a timeout again. Here:

- The map is learned with CLUSTER SLOTS from any server that answers: the servers the map names,
  then the configured ones (the URL's node and `startup_nodes`), so the URL's node being gone
  costs nothing once the map is known.
- A MOVED reply moves its one slot at once (`moved`), and the command is sent again to the new
  owner in the same call (redis_client). A refresh of the whole map (after a server failed, a
  TRYAGAIN or CLUSTERDOWN reply, or a slot nobody serves) runs at most once per
  REFRESH_INTERVAL_S, inside a call and within its deadline.
- A server that fails is down on its own (its `Health`): its slots' keys miss, the others' hit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from redis.crc import key_slot

from kvport.connectors.offloading.tiers.redis.node import REDIS_FAILURES, Health, RedisNode

NUM_SLOTS = 16384
REFRESH_INTERVAL_S = 0.5  # at most one refresh of the whole map this often


class SlotMap:
    """Slot -> server of one cluster; `make_node(host, port)` builds a server's RedisNode."""

    def __init__(self, seeds: list[tuple[str, int]],
                 make_node: Callable[[str, int], RedisNode]) -> None:
        assert seeds, "a cluster needs at least one startup node"
        self._seeds = seeds
        self._make_node = make_node
        self._slots: list[RedisNode | None] = [None] * NUM_SLOTS
        self._nodes: dict[str, RedisNode] = {}  # every server met, by host:port
        self._lock = threading.Lock()  # the map and the nodes
        self._refreshing = threading.Lock()  # one refresh at a time
        self._stale = True  # refresh at the next chance
        self._next_refresh = 0.0  # time.monotonic() before which no refresh starts
        self.health = Health("cluster slot map")  # down: no server gave a map
        self.num_refreshes = 0

    @property
    def loaded(self) -> bool:
        with self._lock:
            return any(n is not None for n in self._slots)

    def node_for(self, key: bytes) -> RedisNode | None:
        """The server of key's slot (None: no server known for it; the map is then stale)."""
        node = self._slots[key_slot(key)]
        if node is None:
            self._stale = True
        return node

    def node_at(self, host: str, port: int) -> RedisNode:
        with self._lock:
            return self._node_locked(host, port)

    def _node_locked(self, host: str, port: int) -> RedisNode:
        name = f"{host}:{port}"
        node = self._nodes.get(name)
        if node is None:
            node = self._nodes[name] = self._make_node(host, port)
        return node

    def moved(self, slot: int, host: str, port: int) -> RedisNode:
        """A MOVED reply: the slot is served by host:port now."""
        with self._lock:
            node = self._slots[slot] = self._node_locked(host, port)
        return node

    def mark_stale(self) -> None:
        """Something suggests the map changed (a server failed, TRYAGAIN, CLUSTERDOWN)."""
        self._stale = True

    def refresh_if_due(self, deadline: float) -> None:
        """Reload the map if it is stale and the last refresh is REFRESH_INTERVAL_S old. With a
        map, one thread refreshes and the others go on with the map they have; without one,
        the others wait for that refresh (until their deadline): they have nothing to route by."""
        if not self._stale:
            return
        loaded = self.loaded
        if loaded:
            if time.monotonic() < self._next_refresh:
                return
            if not self._refreshing.acquire(False):
                return
        elif not self._refreshing.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return
        try:
            if not loaded and self.loaded:
                return  # another thread loaded it while this one waited
            # Without a map every call needs one: the map's down state paces the attempts then.
            admitted = "call" if loaded else self.health.admit()
            if admitted is None:
                return
            try:
                self._next_refresh = time.monotonic() + REFRESH_INTERVAL_S
                self.num_refreshes += 1
                self._refresh(deadline)
            finally:
                self.health.done(admitted)
        finally:
            self._refreshing.release()

    def _refresh(self, deadline: float) -> None:
        with self._lock:
            known = list(dict.fromkeys(n for n in self._slots if n is not None))
            candidates = known + [self._node_locked(h, p) for h, p in self._seeds
                                  if self._nodes.get(f"{h}:{p}") not in known]
        why = "no startup node answered"
        for node in candidates:
            if time.monotonic() >= deadline:
                why = "the call's deadline passed"
                break
            if node.health.is_down and node in known:
                continue  # a failed master's map is the stale one
            try:
                reply = node.call([("CLUSTER", "SLOTS")], deadline)[0]
                ranges = parse_cluster_slots(reply, node.name.rsplit(":", 1)[0])
            except REDIS_FAILURES as exc:
                why = f"{type(exc).__name__}"
                continue
            if isinstance(reply, Exception) or not ranges:
                why = "a node without cluster slots (cluster mode off, or not yet configured)"
                continue
            self._install(ranges)
            self.health.up()
            return
        self.health.down(why)

    def _install(self, ranges: list[tuple[int, int, str, int]]) -> None:
        with self._lock:
            slots: list[RedisNode | None] = [None] * NUM_SLOTS
            for start, end, host, port in ranges:
                node = self._node_locked(host, port)
                for s in range(max(0, start), min(NUM_SLOTS - 1, end) + 1):
                    slots[s] = node
            self._slots = slots
            self._stale = any(n is None for n in slots)

    def close(self) -> None:
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()


def parse_cluster_slots(reply: Any, asked_host: str) -> list[tuple[int, int, str, int]]:
    """(start, end, master host, master port) per range of a raw CLUSTER SLOTS reply; an empty
    host means the server asked. Malformed entries are skipped (never an exception)."""
    if not isinstance(reply, list):
        return []
    out = []
    for entry in reply:
        try:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            out.append((start, end, host or asked_host, int(master[1])))
        except (TypeError, ValueError, IndexError, UnicodeDecodeError):
            continue
    return out
