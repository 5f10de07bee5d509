"""A request's own limits on what a KV connector may load or store: `kv_transfer_params`.

A router or a client sets them per request (vLLM: `SamplingParams.extra_args
["kv_transfer_params"]`, or the OpenAI API's `kv_transfer_params` field; kvport's engine:
`SamplingParams(extra_args=...)` too). The names are vLLM's where vLLM's own OffloadingConnector
has one:

    max_load_tokens     int >= 0: at most this many tokens loaded beyond the engine's own hit
    max_offload_tokens  int >= 0: only blocks within the first this-many tokens are stored
    kv_load_tiers       the tiers a hit may come from; a hit's run ends at the first block
                        held only elsewhere
    kv_store_tiers      (kvport's) the tiers its blocks are written to; host memory stages
                        every store, so a non-empty list names "host"; [] stores nothing

A tier is named by kvport's name ("host", "disk", "redis") or, as vLLM's matchers do, by a dict
`{"medium": "CPU" | "STORAGE", "locality": "LOCAL" | "REMOTE"}` (either key may be left out and
then matches any): host is CPU/LOCAL, disk STORAGE/LOCAL, Redis STORAGE/REMOTE. Other keys
(another connector's) are left alone. A bad value is a ValueError naming the key and the value:
kvport's engine raises it when the request's SamplingParams is made; inside vLLM the connector
cannot fail a request, so it runs that request with no load and no store and counts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# kvport's tiers (mediums.HOST, DISK, REDIS) with vLLM's (medium, locality) for each.
TIERS = {"HOST": ("CPU", "LOCAL"), "DISK": ("STORAGE", "LOCAL"), "REDIS": ("STORAGE", "REMOTE")}
_MEDIUMS = {"CPU", "STORAGE"}
_LOCALITIES = {"LOCAL", "REMOTE"}
KEYS = ("max_load_tokens", "max_offload_tokens", "kv_load_tiers", "kv_store_tiers")


@dataclass(frozen=True)
class TransferLimits:
    """What one request allows a connector; None: no limit."""

    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    load_tiers: frozenset[str] | None = None  # of TIERS' names
    store_tiers: frozenset[str] | None = None

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> TransferLimits:
        """The limits in `params` (a request's kv_transfer_params); ValueError naming a bad
        one."""
        if params is None:
            return NO_LIMITS
        if not isinstance(params, Mapping):
            raise ValueError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
        if not any(key in params for key in KEYS):
            return NO_LIMITS
        store = _tiers(params, "kv_store_tiers")
        if store and "HOST" not in store:
            raise ValueError(f"kv_store_tiers must name host (host memory stages every store) "
                             f"or be empty, got {params['kv_store_tiers']!r}")
        return cls(_count(params, "max_load_tokens"), _count(params, "max_offload_tokens"),
                   _tiers(params, "kv_load_tiers"), store)

    def loads_from(self, medium: str) -> bool:
        return self.load_tiers is None or medium in self.load_tiers

    def stores_to(self, medium: str) -> bool:
        return self.store_tiers is None or medium in self.store_tiers

    @property
    def stores(self) -> bool:
        """Whether any block of the request may be stored."""
        return self.max_offload_tokens != 0 and self.store_tiers != frozenset()


NO_LIMITS = TransferLimits()
# A request whose limits could not be read (inside vLLM): it neither loads nor stores.
NOTHING = TransferLimits(0, 0, frozenset(), frozenset())


def _count(params: Mapping[str, Any], key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value


def _tiers(params: Mapping[str, Any], key: str) -> frozenset[str] | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list of tiers, got {value!r}")
    return frozenset(name for entry in value for name in _matching(key, entry))


def _matching(key: str, entry: Any) -> list[str]:
    """kvport's tiers one entry of a tier list names."""
    if isinstance(entry, str):
        name = entry.upper()
        if name not in TIERS:
            raise ValueError(f"{key}: unknown tier {entry!r} (host, disk or redis)")
        return [name]
    if not isinstance(entry, Mapping) or not set(entry) <= {"medium", "locality"}:
        raise ValueError(f"{key}: a tier is a name or a dict of medium and locality, got "
                         f"{entry!r}")
    medium, locality = entry.get("medium"), entry.get("locality")
    if medium is not None and (not isinstance(medium, str) or medium.upper() not in _MEDIUMS):
        raise ValueError(f"{key}: unknown medium {medium!r} (CPU or STORAGE)")
    if locality is not None and (not isinstance(locality, str)
                                 or locality.upper() not in _LOCALITIES):
        raise ValueError(f"{key}: unknown locality {locality!r} (LOCAL or REMOTE)")
    return [name for name, (m, loc) in TIERS.items()
            if (medium is None or medium.upper() == m)
            and (locality is None or locality.upper() == loc)]
