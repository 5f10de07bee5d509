"""`kvport bench transfer`: host and disk tier bandwidth next to plain copies of the same bytes.

Host tier: for each offload block size S (a multiple of the engine block's B bytes, from B up to
2 MiB), a pool of `total_mib` MiB of engine blocks is stored into host slots and loaded back into
the pool, through `HostTier.store/load` with each copy strategy. The engine block ids and the
slots are shuffled (a pool that has served a while is fragmented; this is the worst case for
merging copies). Baseline: one `Tensor.copy_` of a contiguous `total_mib` MiB buffer with
torch's thread count; the host tier copies with as many threads. Reported: GiB/s (median of
`repeats`) and the ratio to the baseline. Runs on a loaded machine are meaningless (see the
machine's loadavg in the JSON): torch's OpenMP copies collapse when a core is taken.

Disk tier: `disk_mib` MiB of entries of size S are written, then loaded into host slots through a
worker (`disk_threads` threads, jobs of `job_blocks` entries), warm (page cache holds the files)
and cold (each file written, fsynced and dropped from the page cache with
`posix_fadvise(POSIX_FADV_DONTNEED)`). Baseline: `readinto` of one file of the same total bytes,
sequentially, warm and cold. The "Cached" line of /proc/meminfo before and after dropping says
whether the drop worked in this VM.

Redis tier (only with `redis_url`): `redis_mib` MiB of host slots of size S are stored to Redis
(HOST->REDIS, `RedisTier.store_from_host`) and loaded back into other slots (REDIS->HOST,
`RedisTier.load_to_host`), one call per job of `job_blocks` blocks, jobs one after another.
Baseline, on the same server in the same run: redis-py itself doing the same pipelined SETs and
GETs of the same payloads in the same job batches (one pipeline per job, transaction=False, the
tier's client settings), without the tier's own work (the 80-byte header and its xxh3 checksum,
the copy of the slot into the value, the check of every value read and the copy into the slot).
Each round runs both sides back to back (the order alternates between rounds, so drift hits
both), stores first, then loads; the keys are deleted before every round, so every SET writes a
new key. Reported: GiB/s (median of `repeats`) and the ratio tier / redis-py (median of the
rounds' ratios). Keys: the tier's format (`kvport:<namespace digest>:<key hex>`) under a
namespace and tenant salt of this run alone (random), so they never meet real KV; only those
keys are deleted (never FLUSHDB/FLUSHALL), also when the run fails.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

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
MULTI_SEGMENT_STRATEGIES = ("numpy", "runs")


@dataclass(frozen=True)
class TransferBenchConfig:
    geometry: str = "tiny-llama"
    layout: str = "kvport"  # or "vllm-cpu"
    block_sizes: tuple[int, ...] = ()  # offload block sizes in bytes; () = B * 2^k up to 2 MiB
    total_mib: int = 64
    repeats: int = 5
    strategies: tuple[str, ...] = ("numpy", "runs", "gather", "index", "cat")
    disk: bool = True
    disk_mib: int = 128
    disk_dir: str | None = None  # default: a temporary directory under $TMPDIR
    disk_threads: int = 2
    job_blocks: int = 16  # entries per disk load job, values per Redis job
    seed: int = 0
    redis_url: str | None = None  # the Redis tier's rows; None: skipped
    redis_mib: int = 64  # MiB of values per size


    def __post_init__(self) -> None:
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"geometry {self.geometry!r}: expected one of {sorted(GEOMETRIES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: expected one of {sorted(LAYOUTS)}")
        for name in ("total_mib", "repeats", "disk_mib", "disk_threads", "job_blocks",
                     "redis_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        bad = [s for s in self.block_sizes if s < 1 or s % self.engine_block_bytes]
        if bad:
            raise ValueError(f"block sizes {bad} are not multiples of the engine block's "
                             f"{self.engine_block_bytes} bytes")
        if self.redis_url is not None:
            if not self.redis_url.startswith(("redis://", "rediss://")):
                raise ValueError(f"redis_url must be a redis:// or rediss:// URL, got "
                                 f"{redacted_url(self.redis_url)!r}")
            if importlib.util.find_spec("redis") is None:
                raise ValueError(f"the Redis tier's rows need redis-py: {REDIS_INSTALL}")

    @property
    def engine_block_tokens(self) -> int:
        return LAYOUTS[self.layout]

    @property
    def engine_block_bytes(self) -> int:
        layers, heads, head_dim = GEOMETRIES[self.geometry]
        return layers * 2 * self.engine_block_tokens * heads * head_dim * 4

    @property
    def host_strategies(self) -> tuple[str, ...]:
        """The copy strategies this layout supports (a layer-major pool has one segment per
        layer, which only the numpy and runs strategies move)."""
        if self.layout == "kvport":
            return self.strategies
        return tuple(s for s in self.strategies if s in MULTI_SEGMENT_STRATEGIES)

    def sizes(self) -> list[int]:
        if self.block_sizes:
            return sorted(self.block_sizes)
        b, out = self.engine_block_bytes, []
        size = b
        while size <= 2 * MIB:
            out.append(size)
            size *= 2
        return out or [b]


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults of fresh buffers, lazy allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gib_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / GIB if seconds > 0 else float("inf")


def bench_host(cfg: TransferBenchConfig) -> list[dict[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for size in cfg.sizes():
        rows.append(_host_row(cfg, size, gen))
    return rows


def _host_row(cfg: TransferBenchConfig, size: int, gen: Any) -> dict[str, Any]:
    import torch

    from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
    from kvport.connectors.offloading.tiers.engine_pool import EnginePool
    from kvport.connectors.offloading.tiers.host import HostTier

    layers, heads, head_dim = GEOMETRIES[cfg.geometry]
    f = size // cfg.engine_block_bytes
    num_slots = max(1, cfg.total_mib * MIB // size)
    num_blocks = num_slots * f
    bs = cfg.engine_block_tokens
    pool: Any
    if cfg.layout == "kvport":
        pool = torch.randn((num_blocks, layers, 2, bs, heads, head_dim), generator=gen)
    else:  # one storage, layer-major, each layer's pages [block, head, token, K|V] as vLLM's
        storage = torch.randn((layers, num_blocks, heads, bs, 2 * head_dim), generator=gen)
        pool = EnginePool.from_pages([storage[i] for i in range(layers)])
    engine = EngineBlocks(torch.randperm(num_blocks, generator=gen).tolist())
    slots = HostBlocks(torch.randperm(num_slots, generator=gen).tolist())
    num_bytes = num_blocks * cfg.engine_block_bytes
    src, dst = torch.randn(num_bytes // 4, generator=gen), torch.empty(num_bytes // 4)
    base = _gib_s(num_bytes, _median_seconds(lambda: dst.copy_(src), cfg.repeats))
    row: dict[str, Any] = {"offload_block_bytes": size, "blocks_per_offload_block": f,
                           "bytes_per_transfer": num_bytes, "torch_copy_gib_s": base}
    for strategy in cfg.host_strategies:
        host = HostTier.for_pool(pool, num_slots, f, strategy)
        store = _gib_s(num_bytes, _median_seconds(partial(host.store, engine, slots), cfg.repeats))
        load = _gib_s(num_bytes, _median_seconds(partial(host.load, slots, engine), cfg.repeats))
        row[strategy] = {"store_gib_s": store, "load_gib_s": load,
                         "store_ratio": store / base, "load_ratio": load / base}
    return row


def _cached_kib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Cached:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_disk(cfg: TransferBenchConfig, root: Path) -> list[dict[str, Any]]:
    return [_disk_row(cfg, size, root) for size in cfg.sizes()]


def _disk_row(cfg: TransferBenchConfig, size: int, root: Path) -> dict[str, Any]:
    import torch

    from kvport.connectors.offloading.mediums import DISK, DiskBlocks, HostBlocks
    from kvport.connectors.offloading.tiers.disk import DiskTier
    from kvport.connectors.offloading.tiers.host import HostTier
    from kvport.connectors.offloading.transfers import build_tier_worker

    layers, heads, head_dim = GEOMETRIES[cfg.geometry]
    n = max(1, cfg.disk_mib * MIB // size)
    num_bytes = n * size
    host = HostTier(n, size)
    host.register_engine_pool(torch.empty((1, layers, 2, ENGINE_BLOCK_SIZE, heads, head_dim)))
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    sub = root / f"s{size}"
    sub.mkdir()
    disk = DiskTier(sub, 2 * num_bytes + n * 4096, f"bench-{size}".encode())
    keys = [i.to_bytes(8, "little") * 4 for i in range(n)]
    for i, k in enumerate(keys):
        disk.write(k, host.slot(i))
    one = sub / "one-file.bin"
    with open(one, "wb") as fh:
        fh.write(host.buffer.numpy().data)
    worker = build_tier_worker(host, {DISK: disk}, lower_threads=cfg.disk_threads)
    jobs = [(DiskBlocks(keys[i:i + cfg.job_blocks]),
             HostBlocks(list(range(i, min(n, i + cfg.job_blocks)))))
            for i in range(0, n, cfg.job_blocks)]

    def load_tier() -> None:
        for j, (src, dst) in enumerate(jobs):
            worker.submit(j, src, dst)
        assert worker.wait(range(len(jobs)), timeout=600)
        assert all(r.success for r in worker.get_finished()), "disk bench load failed"

    def read_file() -> None:
        with open(one, "rb", buffering=0) as fh:
            fh.readinto(host.buffer.numpy().data)

    row: dict[str, Any] = {"offload_block_bytes": size, "num_entries": n,
                           "bytes_per_transfer": num_bytes, "cache_dropped_mib": {}}
    tier_files = [disk.path(k) for k in keys]
    for temp in ("warm", "cold"):
        drops: dict[str, list[float]] | None = row["cache_dropped_mib"] if temp == "cold" else None
        tier_s = _timed_reads(load_tier, tier_files, cfg.repeats, drops, "tier")
        file_s = _timed_reads(read_file, [one], cfg.repeats, drops, "one_file")
        row[temp] = {"tier_gib_s": _gib_s(num_bytes, tier_s),
                     "one_file_gib_s": _gib_s(num_bytes, file_s), "ratio": file_s / tier_s}
    row["tier_stats"] = disk.stats.snapshot()
    worker.shutdown()
    return row


def _timed_reads(fn: Callable[[], None], files: list[Path], repeats: int,
                 drops: dict[str, list[float]] | None, what: str) -> float:
    """Median seconds of fn; cold (drops is not None): the files leave the page cache before
    each round, and the drop in the kernel's "Cached" counter is recorded under `what`."""
    if drops is None:
        fn()  # warm: the first round brings every file into the page cache
    times = []
    for _ in range(repeats):
        if drops is not None:
            before = _cached_kib()
            _drop_cache(files)
            after = _cached_kib()
            if before is not None and after is not None:
                drops.setdefault(what, []).append((before - after) / 1024)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Both sides' socket timeout: generous, so a slow moment of a shared machine fails no job.
REDIS_IO_TIMEOUT_S = 30.0
REDIS_NAMESPACE = b"kvport-bench-transfer"  # + the side and the size: no real KV namespace


def check_redis(url: str) -> None:
    """ValueError (a bad argument: exit 2) unless redis-py is installed and `url` answers PING."""
    if importlib.util.find_spec("redis") is None:
        raise ValueError(f"the Redis tier needs redis-py: {REDIS_INSTALL}")
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"--redis-url must be a redis:// or rediss:// URL, got "
                         f"{redacted_url(url)!r}")
    import redis

    client = _redis_client(url, timeout_s=5.0)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ValueError(f"cannot reach Redis at {redacted_url(url)}: {exc}") from None
    finally:
        client.close()


def _redis_client(url: str, timeout_s: float = REDIS_IO_TIMEOUT_S) -> Any:
    """A redis-py client with the tier's settings (no retries), the bench's timeout."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0))


def _redis_server_facts(client: Any, url: str) -> dict[str, Any]:
    """Version and memory policy of the server (ConnectionError: a message naming the URL)."""
    import redis

    try:
        info = client.info("server")
    except redis.RedisError as exc:
        raise RuntimeError(f"cannot reach Redis at {redacted_url(url)}: {exc}") from None
    if info.get("redis_mode") == "cluster":
        raise RuntimeError("kvport bench transfer measures one Redis server; "
                           f"{redacted_url(url)} is a cluster node")
    from redis.utils import HIREDIS_AVAILABLE

    facts: dict[str, Any] = {"url": redacted_url(url), "redis_version": info.get("redis_version"),
                             "maxmemory": None, "maxmemory_policy": None,
                             # both sides parse replies with it: hiredis (C) or redis-py's own
                             "redis_py_version": redis.__version__,
                             "hiredis": bool(HIREDIS_AVAILABLE)}
    try:  # an ACL user may not run CONFIG
        config = client.config_get("maxmemory*")
        facts["maxmemory"] = int(config.get("maxmemory", 0))
        facts["maxmemory_policy"] = config.get("maxmemory-policy")
    except redis.RedisError:
        pass
    return facts


def _delete_keys(client: Any, keys: set[bytes]) -> None:
    """DEL exactly these keys (pipelined, in chunks): never a FLUSHDB on a server we were given."""
    todo = sorted(keys)
    for i in range(0, len(todo), 1000):
        client.delete(*todo[i:i + 1000])
    keys.clear()


def bench_redis(cfg: TransferBenchConfig) -> dict[str, Any]:
    """The Redis tier's rows and the server's facts; every key written is deleted at the end."""
    assert cfg.redis_url is not None
    client = _redis_client(cfg.redis_url)
    written: set[bytes] = set()  # every key a SET may have created, added before the SET
    try:
        facts = _redis_server_facts(client, cfg.redis_url)
        # this run's tenant salt: no other run, and no engine, reads or writes these keys
        salt = f"kvport-bench-{secrets.token_hex(8)}"
        rows = [_redis_row(cfg, size, client, salt, written) for size in cfg.sizes()]
    finally:
        try:
            _delete_keys(client, written)
        finally:
            client.close()
    return {"server": facts, "rows": rows}


def _redis_row(cfg: TransferBenchConfig, size: int, client: Any, salt: str,
               written: set[bytes]) -> dict[str, Any]:
    import hashlib

    import torch

    from kvport.connectors.offloading.config import RedisTierConfig
    from kvport.connectors.offloading.mediums import HostBlocks, RedisBlocks
    from kvport.connectors.offloading.tiers.host import HostTier
    from kvport.connectors.offloading.tiers.redis_client import namespace_digest, value_key
    from kvport.connectors.offloading.tiers.redis_tier import RedisTier

    assert cfg.redis_url is not None
    n = max(1, cfg.redis_mib * MIB // size)
    num_bytes = n * size
    host, back = HostTier(n, size), HostTier(n, size)  # stored from host, loaded into back
    gen = torch.Generator().manual_seed(cfg.seed + size)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8, generator=gen))
    tier = RedisTier(RedisTierConfig(cfg.redis_url, tenant_salt=salt,
                                     io_timeout_s=REDIS_IO_TIMEOUT_S),
                     REDIS_NAMESPACE + b"|tier|%d" % size)
    # redis-py's keys: the tier's format and length, under a namespace of their own
    base_digest = namespace_digest(REDIS_NAMESPACE + b"|redis-py|%d" % size, salt)
    keys = [hashlib.sha256(b"%d/%d" % (size, i)).digest() for i in range(n)]
    tier_keys = {tier.key(k) for k in keys}
    base_keys = [value_key(base_digest, k) for k in keys]
    payloads = [host.slot(i).numpy().data for i in range(n)]  # the slots' bytes, no copy
    jobs = [(list(range(i, min(n, i + cfg.job_blocks))), keys[i:i + cfg.job_blocks])
            for i in range(0, n, cfg.job_blocks)]

    def check(what: str, failed: list[int]) -> None:
        if failed:
            raise RuntimeError(
                f"Redis tier bench, {size} B values: {what} failed for {len(failed)} value(s); "
                f"tier counters {tier.stats.snapshot()}. A full Redis refuses or evicts them: "
                f"give it more maxmemory than 2 x --redis-mib ({2 * cfg.redis_mib} MiB), "
                f"or pass a smaller --redis-mib")

    def tier_store() -> None:
        for slots, ks in jobs:
            done = tier.store_from_host(host, HostBlocks(slots), RedisBlocks(ks))
            check("store", done.failed_indices)

    def tier_load() -> None:
        for slots, ks in jobs:
            done = tier.load_to_host(back, RedisBlocks(ks), HostBlocks(slots))
            check("load", done.failed_indices)

    def base_store() -> None:
        for slots, _ in jobs:
            pipe = client.pipeline(transaction=False)
            for s in slots:
                pipe.execute_command("SET", base_keys[s], payloads[s])
            replies = pipe.execute(raise_on_error=False)
            check("redis-py SET", [i for i, r in enumerate(replies) if r is not True
                                   and r != b"OK"])

    def base_load() -> None:
        for slots, _ in jobs:
            pipe = client.pipeline(transaction=False)
            for s in slots:
                pipe.execute_command("GET", base_keys[s])
            replies = pipe.execute(raise_on_error=False)
            check("redis-py GET", [i for i, r in enumerate(replies)
                                   if not isinstance(r, bytes) or len(r) != size])

    def clear() -> None:
        _delete_keys(client, written)
        written.update(tier_keys)  # the next round's SETs create them again
        written.update(base_keys)

    sides = {"tier": (tier_store, tier_load), "redis_py": (base_store, base_load)}
    times: dict[str, dict[str, list[float]]] = {d: {side: [] for side in sides}
                                                for d in ("store", "load")}
    try:
        for r in range(cfg.repeats + 1):  # round 0: warm-up (connections, first allocations)
            clear()
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for d, direction in enumerate(("store", "load")):
                for side in order:
                    start = time.perf_counter()
                    sides[side][d]()
                    if r > 0:
                        times[direction][side].append(time.perf_counter() - start)
            if r == 0 and not torch.equal(back.buffer, host.buffer):
                raise RuntimeError(f"Redis tier bench, {size} B values: the loaded slots differ "
                                   f"from the stored ones")
    finally:
        tier.close()
    row: dict[str, Any] = {"offload_block_bytes": size, "num_values": n,
                           "job_blocks": cfg.job_blocks, "bytes_per_transfer": num_bytes}
    for direction, by_side in times.items():
        tier_s, base_s = by_side["tier"], by_side["redis_py"]
        row[direction] = {
            "tier_gib_s": _gib_s(num_bytes, statistics.median(tier_s)),
            "redis_py_gib_s": _gib_s(num_bytes, statistics.median(base_s)),
            # tier / redis-py bandwidth per round (both measured back to back), median
            "ratio": statistics.median(b / t for t, b in zip(tier_s, base_s)),
            "tier_s": tier_s, "redis_py_s": base_s}
    row["tier_stats"] = tier.stats.snapshot()
    return row


def run_transfer(cfg: TransferBenchConfig) -> dict[str, Any]:
    from kvport.bench import machine_info
    from kvport.connectors.offloading.tiers.host import DEFAULT_STRATEGY, choose_offload_block_size

    result: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info(),
                              "engine_block_bytes": cfg.engine_block_bytes}
    result["host"] = bench_host(cfg)
    best = {r["offload_block_bytes"]: min(r[DEFAULT_STRATEGY]["store_gib_s"],
                                          r[DEFAULT_STRATEGY]["load_gib_s"])
            for r in result["host"] if DEFAULT_STRATEGY in r}
    if best:
        result["chosen_offload_block_bytes"] = choose_offload_block_size(best)
    if cfg.disk:
        if cfg.disk_dir:
            root = Path(tempfile.mkdtemp(prefix="kvport-bench-", dir=cfg.disk_dir))
        else:
            root = Path(tempfile.mkdtemp(prefix="kvport-bench-"))
        try:
            result["disk"] = bench_disk(cfg, root)
        finally:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    if cfg.redis_url is not None:
        result["redis"] = bench_redis(cfg)
    return result


def format_transfer(result: dict[str, Any]) -> str:
    """Text tables of a result: GiB/s with the ratio to the baseline in ( )."""
    m, cfg = result["machine"], result["config"]
    lines = [(f"host tier, GiB/s (ratio to torch copy); {cfg['geometry']} float32, "
              f"{cfg.get('layout', 'kvport')} pool, engine block "
              f"= {result['engine_block_bytes']} B, {m['torch_threads']} torch threads, "
              f"{cfg['total_mib']} MiB per transfer, median of {cfg['repeats']}")]
    for r in result["host"]:
        cells = [f"{s} store {r[s]['store_gib_s']:.2f} ({r[s]['store_ratio']:.2f}) load "
                 f"{r[s]['load_gib_s']:.2f} ({r[s]['load_ratio']:.2f})"
                 for s in cfg["strategies"] if s in r]
        lines.append(f"  {r['offload_block_bytes']:>8} B  copy {r['torch_copy_gib_s']:.2f}  "
                     + " | ".join(cells))
    if "chosen_offload_block_bytes" in result:
        lines.append(f"  chosen offload block size (90% of the best min(store, load), default "
                     f"strategy): "
                     f"{result['chosen_offload_block_bytes']} B")
    for r in result.get("disk", []):
        cells = [f"{t} tier {r[t]['tier_gib_s']:.2f} vs one file {r[t]['one_file_gib_s']:.2f} "
                 f"({r[t]['ratio']:.2f})" for t in ("warm", "cold")]
        lines.append(f"disk {r['offload_block_bytes']:>8} B x {r['num_entries']}: "
                     + "  ".join(cells))
        for what, dropped in r.get("cache_dropped_mib", {}).items():
            lines.append(f"  {what}: page cache dropped per cold round, MiB: "
                         f"{', '.join(f'{d:.0f}' for d in dropped)} "
                         f"(of {r['bytes_per_transfer'] / MIB:.0f})")
    if "redis" in result:
        srv = result["redis"]["server"]
        lines.append(f"redis tier, GiB/s, tier vs redis-py's own pipelined SET/GET of the same "
                     f"payloads (ratio tier/redis-py); Redis {srv['redis_version']} at "
                     f"{srv['url']}, redis-py {srv.get('redis_py_version')} "
                     f"({'hiredis' if srv.get('hiredis') else 'no hiredis'}), jobs of "
                     f"{cfg['job_blocks']} values, median of {cfg['repeats']}")
        for r in result["redis"]["rows"]:
            cells = [f"{d} tier {r[d]['tier_gib_s']:.2f} vs redis-py {r[d]['redis_py_gib_s']:.2f} "
                     f"({r[d]['ratio']:.2f})" for d in ("store", "load")]
            lines.append(f"redis {r['offload_block_bytes']:>8} B x {r['num_values']}: "
                         + "  ".join(cells))
    return "\n".join(lines)
