"""What `kvport bench transfer` measures (its config and pool cases) and how it times rounds.

A case is one engine pool the project runs: a geometry (the model's layers, KV heads and head
size, float32) in a layout (kvport's block-major pool of 16-token blocks, or vLLM's layer-major
CPU pool of 128-token blocks). Its engine block is the offload block (one engine block, f = 1)
unless `block_sizes` asks for others. Every module of the bench (transfer_host, transfer_disk,
transfer_redis, transfer_format) imports this one and nothing else of the bench.
"""

from __future__ import annotations

import importlib.util
import queue
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvport.connectors.offloading.config import redacted_url

REDIS_INSTALL = "pip install 'kvport[redis]'"
GIB = float(1 << 30)
MIB = 1 << 20
# builtin model -> (num_layers, num_kv_heads, head_dim); float32.
GEOMETRIES = {"tiny-llama": (4, 2, 32), "smollm2-135m": (30, 3, 64)}
ENGINE_BLOCK_SIZE = 16
# Pool layouts: kvport's block-major pool (16-token blocks, one block one contiguous run) and
# vLLM's CPU pool (128-token blocks, layer-major: one engine block is one page per layer).
LAYOUTS = {"kvport": ENGINE_BLOCK_SIZE, "vllm-cpu": 128}


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
    strategies: tuple[str, ...] = ("native",)  # host tier copy strategies
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
        from kvport.connectors.offloading.tiers.host.tier import STRATEGIES

        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ValueError(f"strategies {list(self.strategies)}: expected some of {STRATEGIES}")
        blocks = sorted({c.engine_block_bytes for c in self.cases()})
        bad = [s for s in self.block_sizes if s < 1 or all(s % b for b in blocks)]
        if bad:
            raise ValueError(f"block sizes {bad} are not multiples of an engine block "
                             f"({', '.join(map(str, blocks))} bytes)")
        if self.redis_url is not None:
            if not self.redis_url.startswith(("redis://", "rediss://")):
                raise ValueError(f"redis_url must be a redis:// or rediss:// URL, got "
                                 f"{redacted_url(self.redis_url)!r}")
            if importlib.util.find_spec("redis") is None:
                raise ValueError(f"the Redis tier's rows need redis-py: {REDIS_INSTALL}")

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
        from kvport.connectors.offloading.tiers.host.tier import MULTI_SEGMENT_STRATEGIES

        if case.layout == "kvport":
            return self.strategies
        return tuple(s for s in self.strategies if s in MULTI_SEGMENT_STRATEGIES)


def gib_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / GIB if seconds > 0 else float("inf")


# Pause before each timed side. A torch copy's OpenMP threads keep spinning for a few ms after it
# and take the cores from whatever runs next: the host tier's store measured 5.4 GiB/s right
# after the baseline copy, 9.5 GiB/s 10 ms later (2-vCPU VM), which made it look 0.65x.
SETTLE_S = 0.02


def paired_rounds(sides: Mapping[str, Callable[[], object]], repeats: int,
                  before: Callable[[str], object] | None = None,
                  warm_up: bool = True, settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """Seconds of each side in each of `repeats` rounds. A round runs every side once, back to
    back, in an order that rotates between rounds, so drift on a shared machine (another
    process taking a core for a while) hits every side alike; ratios are then taken per round.
    `before(side)` runs before each side (not timed), e.g. to drop its files' page cache; then
    `settle_s` passes, so that no side pays for the threads the previous one left spinning."""
    names = list(sides)
    if warm_up:  # page faults of fresh buffers, lazy allocations, the page cache
        for name in names:
            if before is not None:
                before(name)
            sides[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if before is not None:
                before(name)
            time.sleep(settle_s)
            start = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratio_stats(side: list[float], base: list[float]) -> dict[str, float]:
    """Bandwidth ratio side / base (= base seconds / side seconds) per round: median, min, max."""
    ratios = [b / s for s, b in zip(side, base)]
    return {"ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}


class HelperThread:
    """Runs functions on one thread of its own, as the transfer worker runs a tier's jobs, so
    that a baseline is timed in the same conditions as the tier: on the 2-vCPU VM of
    BENCHMARKS.md the same `readinto` of 128 MiB ran 5-13 % slower on a waiting helper thread
    than on the main thread (paired, 30 rounds). `run(fn)` blocks until fn returned and
    re-raises what it raised."""

    def __init__(self, name: str = "kvport-bench-helper") -> None:
        self._todo: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (fn := self._todo.get()) is not None:
            try:
                fn()
            except BaseException as exc:  # handed to the caller, which raises it
                self._done.put(exc)
            else:
                self._done.put(None)

    def run(self, fn: Callable[[], object]) -> None:
        self._todo.put(fn)
        exc = self._done.get()
        if exc is not None:
            raise exc

    def wrap(self, fn: Callable[[], object]) -> Callable[[], None]:
        return lambda: self.run(fn)

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join()
