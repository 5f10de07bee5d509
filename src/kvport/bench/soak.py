"""`kvport bench soak`: a mixed workload in kvport's engine with the OffloadingConnector (host,
a disk tier kept at capacity, a Redis that evicts), in a child process that is killed with
SIGKILL at seeded random moments and restarted on the same disk root and Redis.

Every `sample_every_s` the soak records the child's RSS, open descriptors and threads
(/proc), the disk root's bytes and temp files, Redis's used_memory and evicted_keys, and from
the child's own reports the step times (p50, p99) and the connector's hit rate since the last
sample (soak_probe, soak_child). At the end every answer is compared with a reference engine
without a connector (greedy: equal tokens), and the figures with the bounds (soak_report): the
result's `violations` list what broke, and the command's exit code is 1 if any.

Kills: one is due `kill_every_s` x uniform(0.5, 1.5) after the child got ready, once it
finished a request, and not in the last `restart_margin` seconds, so that the last process
starts (sweeping what the killed ones left) and then stops cleanly (SIGTERM: it drains and
shuts down); temp files left after that are a violation.
"""

from __future__ import annotations

import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvport.bench.soak_child import ChildConfig
from kvport.bench.soak_process import ChildProcess, Life, Lines, drain, log_tail
from kvport.bench.soak_probe import DiskUsage, disk_usage, redis_sample, sample_process
from kvport.bench.soak_redis import LocalRedis, delete_tenant_keys, redis_client
from kvport.bench.soak_reference import check_outputs
from kvport.bench.soak_report import SoakBounds, Tick, summarize
from kvport.connectors.offloading.config import redacted_url

READY_DEADLINE_S = 180.0  # a child's start (imports, model, tiers) on a busy machine


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 60.0
    kill_every_s: float = 10.0
    seed: int = 0
    redis_url: str | None = None  # None: a redis-server of the soak's own
    model: str = "builtin:tiny-llama"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int = 64
    concurrency: int = 4
    host_bytes: int = 1 << 20
    disk_max_bytes: int = 3 << 20
    redis_maxmemory_bytes: int = 4 << 20
    sample_every_s: float = 1.0
    threads: int = 1
    work_dir: str | None = None  # None: a temporary directory, removed at the end
    bounds: SoakBounds = SoakBounds()

    def __post_init__(self) -> None:
        for name in ("duration_s", "kill_every_s", "sample_every_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        for name in ("num_kv_blocks", "concurrency", "host_bytes", "disk_max_bytes",
                     "redis_maxmemory_bytes", "threads", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://",
                                                                          "rediss://")):
            raise ValueError("redis_url must be a redis:// or rediss:// URL")

    @property
    def restart_margin_s(self) -> float:
        return max(2.0, 0.25 * self.kill_every_s)


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run the soak; the result (as written to JSON), with `violations` (empty: all bounds
    held)."""
    root = Path(cfg.work_dir) if cfg.work_dir else Path(tempfile.mkdtemp(prefix="kvport-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    own_redis = LocalRedis(root / "redis", cfg.redis_maxmemory_bytes) \
        if cfg.redis_url is None else None
    tenant = f"soak-{random.Random().getrandbits(48):012x}"  # the user's server: our keys only
    try:
        url = own_redis.start().url if own_redis is not None else cfg.redis_url
        assert url is not None, "own server or the user's URL"
        return _soak(cfg, root, url, tenant)
    finally:
        if own_redis is not None:
            own_redis.stop()
        elif cfg.redis_url is not None:
            delete_tenant_keys(cfg.redis_url, tenant)
        if not cfg.work_dir:
            shutil.rmtree(root, ignore_errors=True)


def _kv_transfer_config(cfg: SoakConfig, disk_root: Path, url: str,
                        tenant: str) -> dict[str, Any]:
    redis_tier: dict[str, Any] = {"type": "redis", "url": url}
    if cfg.redis_url is not None:
        redis_tier["tenant"] = tenant
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": cfg.host_bytes,
                "secondary_tiers": [{"type": "disk", "root_dir": str(disk_root),
                                     "max_bytes": cfg.disk_max_bytes}, redis_tier]}}


def _soak(cfg: SoakConfig, root: Path, url: str, tenant: str) -> dict[str, Any]:
    disk_root = root / "disk"
    kv = _kv_transfer_config(cfg, disk_root, url, tenant)
    setpriv = shutil.which("setpriv")
    prefix = [setpriv, "--pdeathsig", "KILL"] if setpriv else []  # children die with the soak
    rng = random.Random(cfg.seed)
    lines: Lines = queue.Queue()
    lives: list[Life] = []
    requests: list[dict[str, Any]] = []
    ticks: list[Tick] = []
    admin = redis_client(url)
    t0 = time.monotonic()
    end_at = t0 + cfg.duration_s

    def start(index: int) -> ChildProcess:
        child_cfg = ChildConfig(model=cfg.model, kv_transfer_config=kv, seed=cfg.seed,
                                incarnation=index, dtype=cfg.dtype, block_size=cfg.block_size,
                                num_kv_blocks=cfg.num_kv_blocks, concurrency=cfg.concurrency,
                                threads=cfg.threads)
        argv = [*prefix, sys.executable, "-m", "kvport.bench.soak_child"]
        life = Life(index=index, started_s=time.monotonic() - t0)
        lives.append(life)
        return ChildProcess(life, argv, child_cfg.to_json(), root / f"child-{index}.log", lines)

    child = start(0)
    kill_at: float | None = None
    next_sample = t0 + cfg.sample_every_s
    steps: list[float] = []  # since the last sample
    finished = 0
    try:
        while True:
            now = time.monotonic()
            life = child.life
            if life.ready_s is not None and kill_at is None:
                kill_at = t0 + life.ready_s + cfg.kill_every_s * rng.uniform(0.5, 1.5)
            if now >= next_sample:
                ticks.append(Tick(
                    t_s=now - t0, incarnation=life.index, ready=life.ready_s is not None,
                    process=sample_process(life.pid),
                    disk=_disk_sample(child, disk_root, cfg.disk_max_bytes),
                    redis=redis_sample(admin), step_ms=tuple(steps), requests=finished,
                    metrics=life.last_metrics))
                steps, finished = [], 0
                next_sample = now + cfg.sample_every_s
            if child.exited() and life.end is None:
                life.end, life.ended_s = f"exited unexpectedly ({child.proc.returncode})", now - t0
                if life.ready_s is None:  # it cannot start: restarting it would only repeat that
                    raise RuntimeError(f"soak child {life.index} exited before it was ready: "
                                       f"{child.log_tail()}")
            if life.end is not None:  # it died: restart it, or end the soak if the time is up
                child.close()
                drain(lines, lives, requests, now - t0)
                if now >= end_at:
                    break
                child, kill_at = start(life.index + 1), None
                continue
            # Served requests and was sampled while ready: each life shows in the resources over
            # time however slowly it started (a busy machine).
            usable = (life.ready_s is not None and life.requests > 0 and bool(ticks)
                      and ticks[-1].incarnation == life.index and ticks[-1].ready)
            if usable and now >= end_at:
                child.stop(t0)
                child.close()
                drain(lines, lives, requests, time.monotonic() - t0)
                break
            # Not in the last restart_margin_s: the last process must get to start (sweeping
            # what the killed ones left) and to stop cleanly.
            if (usable and kill_at is not None and now >= kill_at
                    and end_at - now > cfg.restart_margin_s):
                child.kill(time.monotonic() - t0)
                continue
            if life.ready_s is None and now - t0 - life.started_s > READY_DEADLINE_S:
                raise RuntimeError(f"soak child {life.index} not ready within "
                                   f"{READY_DEADLINE_S} s: {child.log_tail()}")
            wait = max(0.0, min(next_sample, kill_at or next_sample, end_at) - now)
            try:
                index, record = lines.get(timeout=min(wait, 0.2))
            except queue.Empty:
                continue
            if record is not None:
                more, done = lives[index].book(record, time.monotonic() - t0, requests)
                steps.extend(more)
                finished += done
    finally:
        child.close()
        admin.close()
    final_disk = disk_usage(disk_root)
    wall_s = time.monotonic() - t0
    logs = {life.index: log_tail(root / f"child-{life.index}.log") for life in lives
            if life.end not in ("killed", "stopped")}
    reference = check_outputs(requests, cfg.model, cfg.dtype, cfg.block_size, cfg.num_kv_blocks,
                              cfg.threads)
    shown = {**asdict(cfg), "redis_url": redacted_url(cfg.redis_url) if cfg.redis_url else None}
    return summarize(shown, cfg.bounds, cfg.disk_max_bytes,
                     [life.frozen() for life in lives], ticks, reference, final_disk, logs,
                     wall_s)


def _disk_sample(child: ChildProcess, disk_root: Path, max_bytes: int) -> DiskUsage:
    """The disk root's use. A walk races with the tier's writes (a run evicted after the walk
    saw it, and the run that took its place), so one that finds more than max_bytes is taken
    again with the writer stopped (SIGSTOP): a snapshot, which the report then holds to the
    bound. Only then: a stopped process would lengthen the step times measured."""
    use = disk_usage(disk_root)
    if use.bytes <= max_bytes or child.exited():
        return use
    os.kill(child.proc.pid, signal.SIGSTOP)
    try:
        return disk_usage(disk_root)
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
