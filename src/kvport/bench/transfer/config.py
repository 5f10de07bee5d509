"""What `kvport bench transfer` measures: its config and the pool cases.

A case is one engine pool the project runs: a geometry (the model's layers, KV heads and head
size, float32) in a layout (kvport's block-major pool of 16-token blocks, or vLLM's layer-major
CPU pool of 128-token blocks). Its engine block is the offload block (one engine block, f = 1)
unless `block_sizes` asks for others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvport.bench.common.command import JsonObject
from kvport.bench.common.redis import check_redis_url, require_redis_py
from kvport.bench.transfer.strategies import BENCH_STRATEGIES, MULTI_SEGMENT_STRATEGIES
from kvport.connectors.offloading.tiers.host.tier import STRATEGIES as TIER_STRATEGIES

MIB = 1 << 20
# builtin model -> (num_layers, num_kv_heads, head_dim); float32.
GEOMETRIES = {"tiny-llama": (4, 2, 32), "smollm2-135m": (30, 3, 64)}
ENGINE_BLOCK_SIZE = 16
# Pool layouts: kvport's block-major pool (16-token blocks, one block one contiguous run) and
# vLLM's CPU pool (128-token blocks, layer-major: one engine block is one page per layer).
LAYOUTS = {"kvport": ENGINE_BLOCK_SIZE, "vllm-cpu": 128}
# the host tier's own strategies, then the ones only this benchmark copies with
STRATEGIES = (*TIER_STRATEGIES, *BENCH_STRATEGIES)


@dataclass(frozen=True)
class PoolCase:
    geometry: str
    layout: str

    @property
    def block_tokens(self) -> int:
        return LAYOUTS[self.layout]

    @property
    def engine_block_bytes(self) -> int:
        layers, heads, head_dim = GEOMETRIES[self.geometry]
        return layers * 2 * self.block_tokens * heads * head_dim * 4

    @property
    def name(self) -> str:
        return f"{self.geometry}/{self.layout}"


@dataclass(frozen=True)
class TransferBenchConfig:
    geometry: str | None = None  # None: every geometry
    layout: str | None = None  # None: every layout ("kvport", "vllm-cpu")
    block_sizes: tuple[int, ...] = ()  # offload block bytes; () = one engine block (f = 1)
    total_mib: int = 64  # MiB of the large job (host and disk); the host pool holds this much
    small_job_blocks: int = 8  # offload blocks of the small job
    repeats: int = 5
    strategies: tuple[str, ...] = ("native",)  # host copy strategies (STRATEGIES)
    disk: bool = True
    disk_mib: int = 128  # MiB of disk entries per entry size
    disk_dir: str | None = None  # default: a temporary directory under $TMPDIR
    disk_threads: int = 1  # the transfer worker's threads for disk jobs (the connector's)
    job_blocks: int = 16  # values per Redis job
    seed: int = 0
    redis_url: str | None = None  # the Redis tier's rows; None: skipped
    redis_mib: int = 64  # MiB of values per size

    def __post_init__(self) -> None:
        if self.geometry is not None and self.geometry not in GEOMETRIES:
            raise ValueError(f"geometry {self.geometry!r}: expected one of {sorted(GEOMETRIES)}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: expected one of {sorted(LAYOUTS)}")
        for name in ("total_mib", "small_job_blocks", "repeats", "disk_mib", "disk_threads",
                     "job_blocks", "redis_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ValueError(f"strategies {list(self.strategies)}: expected some of {STRATEGIES}")
        blocks = sorted({c.engine_block_bytes for c in self.cases()})
        bad = [s for s in self.block_sizes if s < 1 or all(s % b for b in blocks)]
        if bad:
            raise ValueError(f"block sizes {bad} are not multiples of an engine block "
                             f"({', '.join(map(str, blocks))} bytes)")
        if self.redis_url is not None:
            check_redis_url(self.redis_url, "redis_url")
            require_redis_py("the Redis tier")

    def cases(self) -> list[PoolCase]:
        geometries = [self.geometry] if self.geometry else list(GEOMETRIES)
        layouts = [self.layout] if self.layout else list(LAYOUTS)
        return [PoolCase(g, lay) for lay in layouts for g in geometries]

    def offload_sizes(self, case: PoolCase) -> list[int]:
        """The offload block sizes measured on this case: one engine block, or the given
        sizes that are whole numbers of its engine blocks."""
        if not self.block_sizes:
            return [case.engine_block_bytes]
        return sorted(s for s in self.block_sizes if s % case.engine_block_bytes == 0)

    def sizes(self) -> list[int]:
        """Entry sizes of the disk and Redis rows: the given sizes, else every case's engine
        block."""
        if self.block_sizes:
            return sorted(set(self.block_sizes))
        return sorted({c.engine_block_bytes for c in self.cases()})

    def host_strategies(self, case: PoolCase) -> tuple[str, ...]:
        """The copy strategies this layout supports (a layer-major pool has one segment per
        layer, which only some strategies move)."""
        if case.layout == "kvport":
            return self.strategies
        return tuple(s for s in self.strategies
                     if s in TIER_STRATEGIES or s in MULTI_SEGMENT_STRATEGIES)

    def to_json(self) -> JsonObject:
        return dataclasses.asdict(self)
