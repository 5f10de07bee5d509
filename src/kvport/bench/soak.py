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

import json
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvport.bench.soak_child import ChildConfig
from kvport.bench.soak_probe import disk_usage, redis_sample, sample_process
from kvport.bench.soak_redis import LocalRedis, delete_tenant_keys, redis_client
from kvport.bench.soak_reference import check_outputs
from kvport.bench.soak_report import Incarnation, SoakBounds, Tick, summarize

READY_DEADLINE_S = 180.0  # a child's start (imports, model, tiers) on a busy machine
STOP_DEADLINE_S = 120.0  # a stopped child's drain and shutdown


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


@dataclass
class _Life:
    """What the soak books of one workload process while it runs (frozen as an Incarnation
    for the report)."""

    index: int
    started_s: float
    pid: int = 0
    ready_s: float | None = None
    startup_s: float | None = None
    ended_s: float | None = None
    end: str | None = None
    clean_exit: bool = False
    requests: int = 0
    last_metrics: dict[str, Any] | None = None

    def frozen(self) -> Incarnation:
        return Incarnation(index=self.index, pid=self.pid, started_s=self.started_s,
                           ready_s=self.ready_s, startup_s=self.startup_s, ended_s=self.ended_s,
                           end=self.end or "running at the end", clean_exit=self.clean_exit,
                           requests=self.requests, metrics=self.last_metrics)


class _Child:
    """One workload process and the thread that reads its report lines into a queue."""

    def __init__(self, life: _Life, argv: list[str], log: Path, lines: queue.Queue[Any]) -> None:
        self.info = life
        self.log = log.open("wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log)
        self.info.pid = self.proc.pid
        self.reader = threading.Thread(target=self._read, args=(lines,), daemon=True)
        self.reader.start()

    def _read(self, lines: queue.Queue[Any]) -> None:
        assert self.proc.stdout is not None, "stdout is a pipe"
        for raw in self.proc.stdout:
            try:
                lines.put((self.info.index, json.loads(raw)))
            except ValueError:
                pass  # the line SIGKILL cut short: always the last one
        lines.put((self.info.index, None))

    def close(self) -> None:
        self.reader.join(timeout=30)
        assert not self.reader.is_alive(), "the reader ends at the child's EOF"
        self.log.close()


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
    launcher = [p for p in (shutil.which("setpriv"),) if p]
    prefix = [launcher[0], "--pdeathsig", "KILL"] if launcher else []  # dies with the soak
    rng = random.Random(cfg.seed)
    lines: queue.Queue[Any] = queue.Queue()
    incarnations: list[_Life] = []
    requests: list[dict[str, Any]] = []
    ticks: list[Tick] = []
    admin = redis_client(url)

    def start(index: int) -> _Child:
        child_cfg = ChildConfig(model=cfg.model, kv_transfer_config=kv, seed=cfg.seed,
                                incarnation=index, dtype=cfg.dtype, block_size=cfg.block_size,
                                num_kv_blocks=cfg.num_kv_blocks, concurrency=cfg.concurrency,
                                threads=cfg.threads)
        argv = [*prefix, sys.executable, "-m", "kvport.bench.soak_child", child_cfg.to_json()]
        life = _Life(index=index, started_s=time.monotonic() - t0)
        incarnations.append(life)
        return _Child(life, argv, root / f"child-{index}.log", lines)

    t0 = time.monotonic()
    end_at = t0 + cfg.duration_s
    child = start(0)
    kill_at: float | None = None
    next_sample = t0 + cfg.sample_every_s
    pending_steps: list[float] = []
    pending_requests = 0
    try:
        while True:
            now = time.monotonic()
            info = child.info
            if info.ready_s is not None and kill_at is None:
                kill_at = t0 + info.ready_s + cfg.kill_every_s * rng.uniform(0.5, 1.5)
            if now >= next_sample:
                ticks.append(Tick(
                    t_s=now - t0, incarnation=info.index, ready=info.ready_s is not None,
                    process=sample_process(info.pid),
                    disk=disk_usage(disk_root), redis=redis_sample(admin),
                    step_ms=tuple(pending_steps), requests=pending_requests,
                    metrics=info.last_metrics))
                pending_steps, pending_requests = [], 0
                next_sample = now + cfg.sample_every_s
            if child.proc.poll() is not None and info.end is None:
                info.end = f"exited unexpectedly ({child.proc.returncode})"
                info.ended_s = now - t0
            if info.end is not None:  # it died: restart, or end the soak if the time is up
                child.close()
                _drain(lines, incarnations, requests, t0)
                if now >= end_at:
                    break
                child, kill_at = start(info.index + 1), None
                continue
            usable = info.ready_s is not None and info.requests > 0
            if usable and now >= end_at:
                _stop(child, t0)
                child.close()
                _drain(lines, incarnations, requests, t0)
                break
            if (usable and kill_at is not None and now >= kill_at
                    and end_at - now > cfg.restart_margin_s):
                child.proc.kill()
                child.proc.wait(timeout=60)
                info.end, info.ended_s = "killed", time.monotonic() - t0
                continue
            if info.ready_s is None and now - t0 - info.started_s > READY_DEADLINE_S:
                raise RuntimeError(f"soak child {info.index} not ready within "
                                   f"{READY_DEADLINE_S} s; see {child.log.name}")
            wait = max(0.0, min(next_sample, kill_at or next_sample, end_at) - now)
            try:
                index, record = lines.get(timeout=min(wait, 0.2))
            except queue.Empty:
                continue
            steps, done = _apply(index, record, incarnations, requests, t0)
            pending_steps.extend(steps)
            pending_requests += done
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait(timeout=60)
        admin.close()
    final_disk = disk_usage(disk_root)
    wall_s = time.monotonic() - t0
    logs = {i.index: _tail(root / f"child-{i.index}.log") for i in incarnations
            if i.end not in ("killed", "stopped")}
    reference = check_outputs(requests, cfg.model, cfg.dtype, cfg.block_size, cfg.num_kv_blocks,
                              cfg.threads)
    return summarize(asdict(cfg), cfg.bounds, cfg.disk_max_bytes,
                     [i.frozen() for i in incarnations], ticks, reference, final_disk, logs,
                     wall_s)


def _apply(index: int, record: dict[str, Any] | None, incarnations: list[_Life],
           requests: list[dict[str, Any]], t0: float) -> tuple[list[float], int]:
    """Book one report line of child `index`; returns (its step times, requests finished)."""
    if record is None:
        return [], 0
    info = incarnations[index]
    kind = record.get("kind")
    if kind == "ready":
        info.ready_s = time.monotonic() - t0
        info.startup_s = float(record["startup_s"])
    elif kind == "request":
        info.requests += 1
        record["incarnation"] = index
        requests.append(record)
        return [], 1
    elif kind == "stats":
        info.last_metrics = record["metrics"]
        return [float(x) for x in record["step_ms"]], 0
    elif kind == "done":
        info.clean_exit = True
    return [], 0


def _drain(lines: queue.Queue[Any], incarnations: list[_Life],
           requests: list[dict[str, Any]], t0: float) -> None:
    """Book what is queued (a dead child's last lines) without waiting."""
    while True:
        try:
            index, record = lines.get_nowait()
        except queue.Empty:
            return
        _apply(index, record, incarnations, requests, t0)


def _stop(child: _Child, t0: float) -> None:
    """SIGTERM, then wait for the drain and shutdown (SIGKILL after STOP_DEADLINE_S)."""
    child.proc.terminate()
    try:
        child.proc.wait(timeout=STOP_DEADLINE_S)
        child.info.end = "stopped" if child.proc.returncode == 0 else \
            f"stop failed ({child.proc.returncode})"
    except subprocess.TimeoutExpired:
        child.proc.kill()
        child.proc.wait(timeout=60)
        child.info.end = f"did not stop within {STOP_DEADLINE_S} s"
    child.info.ended_s = time.monotonic() - t0


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""
