"""Hits of a hybrid model (several KV cache groups): the longest prefix every group can load.

Boundary k (the request's first k blocks; past a local hit of `start` blocks) is a hit when every
full-attention group holds its blocks start .. k-1 and every sliding-window group holds the
blocks its window reads before k (`OffloadGeometry.window_range`), each key in the host tier or
in a lower one (disk, Redis: asked once, in one batch, for the keys host memory lacks). A key
being written to host memory counts as missing; if the full groups' run ends at one, the request
may wait for it (hits.py). The hit is the largest such k whose keys outside host memory fit the
host slots a promotion may take.

    blocks        start                                 end of the full groups' run
    full          [h  h  h  d  d  d  h  h  h  h  -]      h host, d disk, - missing
    sliding       [.  .  .  .  .  .  .  h  h  .  .]      k = 9: the window (n = 2) is held

Where a sliding window cuts the hit short of the full groups' run (k = 9 < 10 above), this prompt
shares the run's prefix with a stored prompt that went on past it: that boundary (the junction)
is one later prompts will likely share too, so the request stores the window before it as it
computes it (stores.py), and the next prompt with that prefix hits there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.manager.policy import PolicyManager
from kvport.connectors.offloading.mediums import HOST
from kvport.connectors.offloading.scheduler.lower_lookup import LowerLookup


@dataclass
class GroupHit:
    end: int  # the boundary k (start: no hit)
    # Every key the hit loads, host ones first: (group, block, key, medium), in block order.
    parts: list[tuple[int, int, bytes, str]] = field(default_factory=list)
    media: list[str] = field(default_factory=list)  # per hit block, the tier it counts for
    touched: list[bytes] = field(default_factory=list)  # host keys to mark recently used
    blocked: bool = False  # the full groups' run ended at a key being written to host memory
    # Where the full groups' run ended, if a sliding group's window cut the hit short of it:
    # this prompt shares that prefix with a stored one, so the request stores the window there.
    junction: int | None = None


def find_group_hit(g: OffloadGeometry, manager: PolicyManager, lower: LowerLookup,
                   keys: tuple[list[bytes], ...], start: int, limit: int,
                   room: int) -> GroupHit:
    """The hit of blocks [start, k) for the largest k <= `limit`; `room`: host slots the keys
    outside host memory may be promoted into."""
    full = [grp for grp, w in enumerate(g.group_windows) if w is None]
    ready = {key for ks in keys for key in ks[start:limit] if manager.lookup((key,))}
    found: dict[bytes, str] = {}
    if lower and room > 0:
        # Past the full groups' host run, at most `room` blocks can be promoted.
        host_end = _run_end(keys, full, ready, start, limit)
        asked = [key for i in range(start, min(limit, host_end + room)) for ks in keys
                 if (key := ks[i]) not in ready and not manager.contains(key)]
        found = lower.find_each(asked)
    held = ready | found.keys()
    end = _run_end(keys, full, held, start, limit)
    blocked = bool(full) and end < limit and any(
        manager.contains(keys[grp][end]) and keys[grp][end] not in ready for grp in full)
    # Per sliding group, how many of its blocks start .. i-1 are missing: a window is held when
    # the count does not grow over it.
    missing = {grp: [0, *accumulate(keys[grp][i] not in held for i in range(start, end))]
               for grp in g.sliding_groups}
    for k in range(end, start, -1):
        windows = {grp: g.window_range(grp, start, k) for grp in missing}
        if any(counts[w.stop - start] != counts[w.start - start]
               for grp, counts in missing.items() if (w := windows[grp])):
            continue
        parts = [(grp, i, keys[grp][i]) for i in range(start, k) for grp in range(len(keys))
                 if grp in full or i in windows[grp]]
        media = [HOST if key in ready else found[key] for _, _, key in parts]
        if sum(m != HOST for m in media) > room:
            continue  # more promotions than free slots: a shorter hit
        ordered = sorted(zip(parts, media), key=lambda pm: pm[1] != HOST)  # stable: host first
        return GroupHit(k, [(grp, i, key, m) for (grp, i, key), m in ordered],
                        _block_media(parts, media, start, k),
                        [key for (_, _, key), m in zip(parts, media) if m == HOST],
                        blocked, end if end > k else None)
    return GroupHit(start, blocked=blocked, junction=end if end > start else None)


def _run_end(keys: tuple[list[bytes], ...], full: list[int], held: set[bytes], start: int,
             limit: int) -> int:
    """The first block from `start` on that some full group does not hold (`limit` if none)."""
    return min((next((i for i in range(start, limit) if keys[grp][i] not in held), limit)
                for grp in full), default=limit)


def _block_media(parts: list[tuple[int, int, bytes]], media: list[str], start: int,
                 k: int) -> list[str]:
    """Per block of the hit, the tier its tokens count for: a lower tier if any of its keys
    comes from one (that copy decides when the block is there), else HOST."""
    out = [HOST] * (k - start)
    for (_, i, _), m in zip(parts, media):
        if m != HOST:
            out[i - start] = m
    return out
