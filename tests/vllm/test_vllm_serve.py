"""`vllm serve` with kvport's OffloadingConnector, queried as a user would, with the openai
client: completions and streaming chat; a long prompt repeated after the engine's own prefix
cache was dropped is served from kvport's host tier, and /metrics shows kvport's metrics, those
of its Redis tier (a real redis-server) among them; kv_transfer_params per request, a bad one
refused with a 400 (kvport.vllm.params)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from polling import poll_until
from redis_fixtures import RedisServer

from kvport.model.builtin import builtin_model_dir

MODEL = "smollm2"
LONG = ("You are a helpful assistant. "
        + " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40)))
START_DEADLINE_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "vllm.log"
    ktc = {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20, "secondary_tiers": [
               {"type": "redis", "url": redis.url}]}}
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="2")
    cmd = [sys.executable, "-m", "kvport.vllm", "serve",
           str(builtin_model_dir("smollm2-135m")), "--served-model-name", MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "4",
           "--kv-transfer-config", json.dumps(ktc),
           "--logits-processors", "kvport.vllm.params:KVTransferParamsCheck"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited ({proc.returncode}):\n"
                                 f"{Path(log).read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        try:  # a server process starting: 0.5 s between tries
            poll_until(ready, "vllm serve ready", START_DEADLINE_S, interval_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{Path(log).read_text()[-4000:]}") from None
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def reset_engine_cache(url: str) -> None:
    """Drop vLLM's own prefix cache (not kvport's host tier); retried while in-flight requests
    still hold blocks."""
    def reset() -> bool:
        req = urllib.request.Request(url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return bool(json.load(r).get("success"))

    poll_until(reset, "vLLM resets its prefix cache", 10.0, interval_s=0.2)


def kvport_metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_completions_repeat_from_the_host_tier_and_metrics_show_it(server: str) -> None:
    client = OpenAI(base_url=server + "/v1", api_key="unused")
    first = client.completions.create(model=MODEL, prompt=LONG + " What is 7 squared?",
                                      max_tokens=8, temperature=0.0)
    reset_engine_cache(server)
    again = client.completions.create(model=MODEL, prompt=LONG + " What is 7 squared?",
                                      max_tokens=8, temperature=0.0)
    assert again.choices[0].text == first.choices[0].text
    assert kvport_metric(server, "vllm:kvport_hit_tokens_total", tier="host") >= 640
    assert kvport_metric(server, "vllm:kv_offload_store_bytes_total") > 0  # vLLM's own name
    assert kvport_metric(server, "vllm:kv_offload_load_bytes_total") > 0
    assert kvport_metric(server, "vllm:kvport_occupancy_bytes", tier="host") > 0
    assert kvport_metric(server, "vllm:kvport_prompt_tokens_total", source="host") >= 640
    assert kvport_metric(server, "vllm:kvport_prompt_tokens_total", source="computed") > 0
    assert kvport_metric(server, "vllm:kvport_store_blocks_total", tier="host",
                         outcome="stored") >= 5
    # measured from vLLM's first read of the stats on (the first request's lookup is before it)
    assert kvport_metric(server, "vllm:kvport_lookup_seconds_count", tier="host") >= 1
    assert kvport_metric(server, "vllm:kv_offload_lookup_sync_delay_seconds_count") >= 1
    # The Redis tier: written through, asked once per request, nothing went wrong. The
    # write-through runs beside the engine (0.2 s here) and is reported by the step after it
    # ended (vLLM keeps stepping while it is pending), so it may land after the second request.
    poll_until(lambda: kvport_metric(server, "vllm:kv_offload_tiering_write_bytes_total",
                                     tier="redis") > 0,
               "the Redis write-through shows in /metrics", 30.0, interval_s=0.1)
    assert kvport_metric(server, "vllm:kvport_redis_round_trips_total", side="scheduler") > 0
    assert kvport_metric(server, "vllm:kvport_redis_problems_total") == 0


def test_streaming_chat_with_a_long_system_prompt(server: str) -> None:
    client = OpenAI(base_url=server + "/v1", api_key="unused")
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "What is 12 squared?"}]

    def chat() -> str:
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                temperature=0.0, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    before = kvport_metric(server, "vllm:kvport_hit_tokens_total", tier="host")
    text = chat()
    reset_engine_cache(server)
    assert chat() == text and text
    assert kvport_metric(server, "vllm:kvport_hit_tokens_total", tier="host") > before


def test_a_request_with_a_bad_parameter_fails_alone(server: str) -> None:
    client = OpenAI(base_url=server + "/v1", api_key="unused")
    with pytest.raises(Exception, match=re.compile("max_tokens|maximum context", re.I)):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0.0)
    assert ok.choices[0].text is not None


def test_kv_transfer_params_per_request_and_a_bad_one_is_a_400(server: str) -> None:
    client = OpenAI(base_url=server + "/v1", api_key="unused")
    prompt = LONG + " What is 9 squared?"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0)
    reset_engine_cache(server)
    limited = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                        temperature=0.0,
                                        extra_body={"kv_transfer_params": {"max_load_tokens": 0}})
    assert limited.choices[0].text == first.choices[0].text
    with pytest.raises(Exception, match="kv_load_tiers: unknown tier 'tape'") as bad:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                  extra_body={"kv_transfer_params": {"kv_load_tiers": ["tape"]}})
    assert getattr(bad.value, "status_code", None) == 400
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0.0)
    assert ok.choices[0].text is not None


def test_the_dashboard_reads_what_metrics_serves(server: str) -> None:
    """Every family the shipped Grafana dashboard queries is one /metrics declares, and the
    ones this server's tiers fill (host, Redis) have samples."""
    dashboard = json.loads((Path(__file__).parents[2] / "dashboards/kvport-vllm.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {re.sub(r"_(bucket|total)$", "", name)
               for e in exprs for name in re.findall(r"vllm:[a-z_:]+", e)}
    with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
        text = r.read().decode()
    declared = {re.sub(r"_total$", "", name)  # a counter's TYPE line names it with _total
                for name in re.findall(r"^# TYPE (vllm:\S+) ", text, re.M)}
    assert queried - declared == set(), "the dashboard queries families /metrics lacks"
    client = OpenAI(base_url=server + "/v1", api_key="unused")
    client.completions.create(model=MODEL, prompt=LONG + " What is 3 squared?", max_tokens=2,
                              temperature=0.0)
    filled = {"vllm:kvport_prompt_tokens", "vllm:kvport_hit_tokens", "vllm:kv_offload_load_bytes",
              "vllm:kv_offload_store_bytes", "vllm:kvport_lookup_seconds",
              "vllm:kv_offload_lookup_sync_delay_seconds", "vllm:kvport_store_blocks",
              "vllm:kv_offload_tiering_write_bytes", "vllm:kv_offload_store_size",
              "vllm:kv_offload_cpu_cache_usage_perc", "vllm:kvport_occupancy_bytes"}
    assert filled <= queried
    with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
        text = r.read().decode()
    sampled = {re.sub(r"_(bucket|total|count|sum)$", "", m)
               for m in re.findall(r"^(vllm:[a-z_:]+)\{", text, re.M)}
    assert filled - sampled == set(), "families without samples after a workload"
