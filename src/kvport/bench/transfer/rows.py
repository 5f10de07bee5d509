"""The typed rows and result of `kvport bench transfer`, and the JSON each is written as (the
keys of earlier runs, so that old files read the same).

GiB/s are of the median seconds over rounds; a ratio is side / baseline bandwidth per round, its
median (with min and max where the rounds disagree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvport.bench.common.command import JsonObject
from kvport.bench.common.machine import MachineInfo
from kvport.bench.transfer.config import PoolCase, TransferBenchConfig
from kvport.bench.transfer.timing import RatioStats

TierStats = Mapping[str, Any]  # a tier's counters: its `stats.snapshot()` record, as a dict


@dataclass(frozen=True)
class HostSides:
    """One copy strategy's store and load next to the torch copy of the same rounds."""

    store_gib_s: float
    load_gib_s: float
    store: RatioStats
    load: RatioStats

    def to_json(self) -> JsonObject:
        return {"store_gib_s": self.store_gib_s, "load_gib_s": self.load_gib_s,
                **{f"store_{k}": v for k, v in dataclasses.asdict(self.store).items()},
                **{f"load_{k}": v for k, v in dataclasses.asdict(self.load).items()}}


@dataclass(frozen=True)
class HostRow:
    """Jobs of `job_blocks` offload blocks of one pool case into `slots` ("consecutive" or
    "scattered") host slots; `torch_copy_gib_s` is the last strategy's baseline."""

    case: PoolCase
    offload_block_bytes: int
    job_blocks: int
    num_jobs: int
    slots: str
    bytes_per_transfer: int
    torch_threads: int
    torch_copy_gib_s: float | None
    strategies: dict[str, HostSides]  # strategy -> its sides

    def to_json(self) -> JsonObject:
        return {"case": self.case.name, "geometry": self.case.geometry,
                "layout": self.case.layout, "engine_block_bytes": self.case.engine_block_bytes,
                "offload_block_bytes": self.offload_block_bytes, "job_blocks": self.job_blocks,
                "num_jobs": self.num_jobs, "slots": self.slots,
                "bytes_per_transfer": self.bytes_per_transfer,
                "torch_threads": self.torch_threads, "torch_copy_gib_s": self.torch_copy_gib_s,
                **{name: sides.to_json() for name, sides in self.strategies.items()}}


@dataclass(frozen=True)
class DiskSides:
    """The tier next to one sequential file of the same bytes."""

    tier_gib_s: float
    one_file_gib_s: float
    ratio: RatioStats

    def to_json(self) -> JsonObject:
        return {"tier_gib_s": self.tier_gib_s, "one_file_gib_s": self.one_file_gib_s,
                **dataclasses.asdict(self.ratio)}


@dataclass(frozen=True)
class ExtraRead:
    """A further plain read of the one file, beside the baseline: its bandwidth, and the tier's
    bandwidth over it."""

    gib_s: float
    tier_ratio: float


@dataclass(frozen=True)
class WarmLoad:
    sides: DiskSides
    read_threads: int  # threads the tier reads a large cached extent with
    extras: dict[str, ExtraRead]  # "checked_file", "main_thread_file", "split_file"

    def to_json(self) -> JsonObject:
        out = {**self.sides.to_json(), "read_threads": self.read_threads}
        for name, extra in self.extras.items():
            out[f"{name}_gib_s"] = extra.gib_s
            out[f"ratio_to_{name}"] = extra.tier_ratio
        return out


@dataclass(frozen=True)
class DeviceReads:
    """The block device's read requests during a cold side, and their mean size (medians)."""

    requests: float
    mean_kib: float


@dataclass(frozen=True)
class ColdLoad:
    sides: DiskSides
    device_requests: dict[str, DeviceReads]  # side -> its reads ({} without a block device)

    def to_json(self) -> JsonObject:
        return {**self.sides.to_json(), "device_requests": {
            side: dataclasses.asdict(reads) for side, reads in self.device_requests.items()}}


@dataclass(frozen=True)
class DiskRow:
    offload_block_bytes: int
    num_entries: int
    job_blocks: int
    bytes_per_transfer: int
    store: DiskSides | None  # on the row of the large job only
    warm: WarmLoad
    cold: ColdLoad
    tier_stats: TierStats

    def to_json(self) -> JsonObject:
        return {"offload_block_bytes": self.offload_block_bytes, "num_entries": self.num_entries,
                "job_blocks": self.job_blocks, "bytes_per_transfer": self.bytes_per_transfer,
                "store": self.store.to_json() if self.store is not None else None,
                "warm": self.warm.to_json(), "cold": self.cold.to_json(),
                "tier_stats": dict(self.tier_stats)}


@dataclass(frozen=True)
class RedisDirection:
    """Stores or loads: the tier next to redis-py's own pipelined SET or GET, per round."""

    tier_gib_s: float
    redis_py_gib_s: float
    ratio: float  # tier / redis-py bandwidth per round (back to back), median
    tier_s: list[float]
    redis_py_s: list[float]


@dataclass(frozen=True)
class RedisRow:
    offload_block_bytes: int
    num_values: int
    job_blocks: int
    bytes_per_transfer: int
    store: RedisDirection
    load: RedisDirection
    tier_stats: TierStats

    def to_json(self) -> JsonObject:
        return {**dataclasses.asdict(self), "tier_stats": dict(self.tier_stats)}


@dataclass(frozen=True)
class RedisServerFacts:
    url: str  # its password redacted
    redis_version: str | None
    maxmemory: int | None  # None where an ACL user may not run CONFIG
    maxmemory_policy: str | None
    redis_py_version: str  # both sides parse replies with hiredis (C) or redis-py's own
    hiredis: bool


@dataclass(frozen=True)
class RedisRows:
    server: RedisServerFacts
    rows: tuple[RedisRow, ...]

    def to_json(self) -> JsonObject:
        return {"server": dataclasses.asdict(self.server),
                "rows": [r.to_json() for r in self.rows]}


@dataclass(frozen=True)
class TransferTarget:
    what: str
    ratio: float
    limit: float
    against: str
    met: bool


@dataclass(frozen=True)
class TransferResult:
    config: TransferBenchConfig
    machine: MachineInfo
    host: tuple[HostRow, ...]
    disk: tuple[DiskRow, ...] | None  # None: --no-disk
    redis: RedisRows | None  # None: no Redis URL
    other_load_cores: float | None
    steal_cores: float | None  # of the other load, what the hypervisor took
    targets: tuple[TransferTarget, ...]

    def to_json(self) -> JsonObject:
        out: JsonObject = {
            "config": self.config.to_json(), "machine": self.machine.to_json(),
            "cases": [{"case": c.name, "engine_block_bytes": c.engine_block_bytes}
                      for c in self.config.cases()],
            "host": [r.to_json() for r in self.host]}
        if self.disk is not None:
            out["disk"] = [r.to_json() for r in self.disk]
        if self.redis is not None:
            out["redis"] = self.redis.to_json()
        out.update(other_load_cores=self.other_load_cores, steal_cores=self.steal_cores,
                   targets=[dataclasses.asdict(t) for t in self.targets])
        return out
