"""`kvport bench soak`: a mixed workload in kvport's engine with the OffloadingConnector (host,
a disk tier kept at capacity, a Redis that evicts), in a child process that is killed with
SIGKILL at seeded random moments and restarted on the same disk root and Redis.

Every `sample_every_s` the soak records the child's RSS, open descriptors and threads
(/proc), the disk root's bytes and temp files, Redis's used_memory and evicted_keys, and from
the child's own reports the step times (p50, p99) and the connector's hit rate since the last
sample (probe, child). At the end every answer is compared with a reference engine without a
connector (greedy: equal tokens), and the figures with the bounds (report): the
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

from kvport.bench.common.command import JsonObject
from kvport.bench.common.redis import check_redis_url, delete_matching, redis_client
from kvport.bench.soak.child import ChildConfig
from kvport.bench.soak.probe import DiskUsage, disk_usage, redis_sample, sample_process
from kvport.bench.soak.process import ChildProcess, Life, Lines, drain, log_tail
from kvport.bench.soak.redis_server import LocalRedis
from kvport.bench.soak.reference import check_outputs
from kvport.bench.soak.result import SoakBounds, SoakResult, Tick, summarize
from kvport.connectors.offloading.config import redacted_url

READY_DEADLINE_S = 180.0  # a child's start (imports, model, tiers) on a busy machine
# the samples' Redis client: a stuck server makes a sample missing, never the soak stuck
ADMIN_TIMEOUT_S = 2.0


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
        if self.redis_url is not None:
            check_redis_url(self.redis_url, "redis_url")

    @property
    def restart_margin_s(self) -> float:
        return max(2.0, 0.25 * self.kill_every_s)


def run_soak(cfg: SoakConfig) -> SoakResult:
    """Run the soak; the result, with `violations` (empty: all bounds held)."""
    root = Path(cfg.work_dir) if cfg.work_dir else Path(tempfile.mkdtemp(prefix="kvport-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    own_redis = LocalRedis(root / "redis", cfg.redis_maxmemory_bytes) \
        if cfg.redis_url is None else None
    tenant = f"soak-{random.Random().getrandbits(48):012x}"  # the user's server: our keys only
    try:
        url = own_redis.start().url if own_redis is not None else cfg.redis_url
        assert url is not None, "own server or the user's URL"
        return Soak(cfg, root, url, tenant).run()
    finally:
        if own_redis is not None:
            own_redis.stop()
        elif cfg.redis_url is not None:
            _delete_tenant_keys(cfg.redis_url, tenant)
        if not cfg.work_dir:
            shutil.rmtree(root, ignore_errors=True)


def _delete_tenant_keys(url: str, tenant: str) -> int:
    """Delete the keys under kvport:<tenant>: on a user's server (the soak's own tenant only);
    returns how many."""
    client = redis_client(url, timeout_s=ADMIN_TIMEOUT_S)
    try:
        return delete_matching(client, f"kvport:{tenant}:*".encode())
    finally:
        client.close()


def _kv_transfer_config(cfg: SoakConfig, disk_root: Path, url: str,
                        tenant: str) -> JsonObject:
    redis_tier: JsonObject = {"type": "redis", "url": url}
    if cfg.redis_url is not None:
        redis_tier["tenant"] = tenant
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": cfg.host_bytes,
                "secondary_tiers": [{"type": "disk", "root_dir": str(disk_root),
                                     "max_bytes": cfg.disk_max_bytes}, redis_tier]}}


class Soak:
    """One soak: the workload process started, sampled, killed at its seeded moments and
    restarted, until the time is up; then the reference and the report."""

    def __init__(self, cfg: SoakConfig, root: Path, url: str, tenant: str) -> None:
        self.cfg, self.root = cfg, root
        self.disk_root = root / "disk"
        self.kv = _kv_transfer_config(cfg, self.disk_root, url, tenant)
        setpriv = shutil.which("setpriv")
        # children die with the soak
        self.prefix = [setpriv, "--pdeathsig", "KILL"] if setpriv else []
        self.rng = random.Random(cfg.seed)
        self.lines: Lines = queue.Queue()
        self.lives: list[Life] = []
        self.requests: list[JsonObject] = []
        self.ticks: list[Tick] = []
        self.admin = redis_client(url, timeout_s=ADMIN_TIMEOUT_S)
        self.t0 = time.monotonic()
        self.end_at = self.t0 + cfg.duration_s
        self.kill_at: float | None = None
        self.next_sample = self.t0 + cfg.sample_every_s
        self.steps: list[float] = []  # since the last sample
        self.finished = 0  # requests since the last sample
        self.child = self._start(0)

    def run(self) -> SoakResult:
        try:
            while not self._turn():
                pass
        finally:
            self.child.close()
            self.admin.close()
        return self._result()

    def _start(self, index: int) -> ChildProcess:
        cfg = self.cfg
        child_cfg = ChildConfig(model=cfg.model, kv_transfer_config=self.kv, seed=cfg.seed,
                                incarnation=index, dtype=cfg.dtype, block_size=cfg.block_size,
                                num_kv_blocks=cfg.num_kv_blocks, concurrency=cfg.concurrency,
                                threads=cfg.threads)
        argv = [*self.prefix, sys.executable, "-m", "kvport.bench.soak.child"]
        life = Life(index=index, started_s=time.monotonic() - self.t0)
        self.lives.append(life)
        return ChildProcess(life, argv, child_cfg.to_json(), self.root / f"child-{index}.log",
                            self.lines)

    def _turn(self) -> bool:
        """One turn of the soak's loop: a sample when due, a dead child restarted, a kill when
        due, one report line booked; True when the soak is over."""
        now, cfg, life = time.monotonic(), self.cfg, self.child.life
        if life.ready_s is not None and self.kill_at is None:
            self.kill_at = self.t0 + life.ready_s + cfg.kill_every_s * self.rng.uniform(0.5, 1.5)
        if now >= self.next_sample:
            self._sample(now)
        if self.child.exited() and life.end is None:
            life.end = f"exited unexpectedly ({self.child.proc.returncode})"
            life.ended_s = now - self.t0
            if life.ready_s is None:  # it cannot start: restarting it would only repeat that
                raise RuntimeError(f"soak child {life.index} exited before it was ready: "
                                   f"{self.child.log_tail()}")
        if life.end is not None:  # it died: restart it, or end the soak if the time is up
            self.child.close()
            drain(self.lines, self.lives, self.requests, now - self.t0)
            if now >= self.end_at:
                return True
            self.child, self.kill_at = self._start(life.index + 1), None
            return False
        # Served requests and was sampled while ready: each life shows in the resources over
        # time however slowly it started (a busy machine).
        usable = (life.ready_s is not None and life.requests > 0 and bool(self.ticks)
                  and self.ticks[-1].incarnation == life.index and self.ticks[-1].ready)
        if usable and now >= self.end_at:
            self.child.stop(self.t0)
            self.child.close()
            drain(self.lines, self.lives, self.requests, time.monotonic() - self.t0)
            return True
        # Not in the last restart_margin_s: the last process must get to start (sweeping
        # what the killed ones left) and to stop cleanly.
        if (usable and self.kill_at is not None and now >= self.kill_at
                and self.end_at - now > cfg.restart_margin_s):
            self.child.kill(time.monotonic() - self.t0)
            return False
        if life.ready_s is None and now - self.t0 - life.started_s > READY_DEADLINE_S:
            raise RuntimeError(f"soak child {life.index} not ready within "
                               f"{READY_DEADLINE_S} s: {self.child.log_tail()}")
        self._book_next(now)
        return False

    def _sample(self, now: float) -> None:
        life = self.child.life
        self.ticks.append(Tick(
            t_s=now - self.t0, incarnation=life.index, ready=life.ready_s is not None,
            process=sample_process(life.pid),
            disk=_disk_sample(self.child, self.disk_root, self.cfg.disk_max_bytes),
            redis=redis_sample(self.admin), step_ms=tuple(self.steps), requests=self.finished,
            metrics=life.last_metrics))
        self.steps, self.finished = [], 0
        self.next_sample = now + self.cfg.sample_every_s

    def _book_next(self, now: float) -> None:
        """Wait for the next report line (not past the next sample, kill or the end) and book
        it."""
        wait = max(0.0, min(self.next_sample, self.kill_at or self.next_sample, self.end_at) - now)
        try:
            index, record = self.lines.get(timeout=min(wait, 0.2))
        except queue.Empty:
            return
        if record is not None:
            more, done = self.lives[index].book(record, time.monotonic() - self.t0,
                                                self.requests)
            self.steps.extend(more)
            self.finished += done

    def _result(self) -> SoakResult:
        cfg = self.cfg
        final_disk = disk_usage(self.disk_root)
        wall_s = time.monotonic() - self.t0
        logs = {life.index: log_tail(self.root / f"child-{life.index}.log")
                for life in self.lives if life.end not in ("killed", "stopped")}
        reference = check_outputs(self.requests, cfg.model, cfg.dtype, cfg.block_size,
                                  cfg.num_kv_blocks, cfg.threads)
        shown = {**asdict(cfg),
                 "redis_url": redacted_url(cfg.redis_url) if cfg.redis_url else None}
        return summarize(shown, cfg.bounds, cfg.disk_max_bytes,
                         [life.frozen() for life in self.lives], self.ticks, reference,
                         final_disk, logs, wall_s)


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
