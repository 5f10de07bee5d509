"""`kvport bench serve`, its pure parts and the processes it owns, without vLLM: the datasets
(the multi-turn file, the routes), the flags, the pool, the parsing of vLLM's results and of
/metrics, the ratios, targets and table, the forwarder (against stdlib servers), a server that
fails or hangs (fake programs), and the Redis keys of a run (a real redis-server)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from needs import require
from redis_fixtures import RedisServer

from kvport.bench.cli import main
from kvport.bench.serve.config import (
    BASELINE,
    HOST,
    HOST_DISK,
    HOST_REDIS,
    MULTI_TURN,
    PREFILL_DECODE,
    SHARED_PREFIX,
    SPLIT_REDIS,
    TWO_INSTANCES,
    ServeBenchConfig,
    kv_transfer_config,
    pool_plan,
)
from kvport.bench.serve.datasets import (
    ConversationSpec,
    SharedPrefixSpec,
    Turn,
    alternating_instances,
    check_prompt_tokens,
    conversation_turns,
    prefix_repetition_args,
    sharegpt_args,
    sharegpt_entries,
    single_token_words,
)
from kvport.bench.serve.forwarder import Forwarder, route_of
from kvport.bench.serve.metrics import (
    counter_delta,
    counter_values,
    hit_summary,
    parse_prometheus,
    sum_deltas,
)
from kvport.bench.serve.plot import plot_result
from kvport.bench.serve.report import format_result, verdict_line
from kvport.bench.serve.result import (
    TARGETS,
    RunResult,
    ServeBenchResult,
    client_figures,
    evaluate_targets,
    ratios,
)
from kvport.bench.serve.run import RedisTier, sigterm_interrupts
from kvport.bench.serve.server import (
    ServerFailed,
    ServerProcess,
    ServerSpec,
    server_argv,
    server_env,
    server_last_error,
)
from kvport.config import KVTransferConfig
from kvport.connectors.factory import parse_extra_config
from kvport.connectors.offloading.config import OffloadingConfig

WORDS = [f"w{i}" for i in range(40)]
CHAT = ConversationSpec(conversations=3, turns=3, system_len=5, context_len=7, user_len=2,
                        reply_len=3, output_len=4)


# ---- datasets --------------------------------------------------------------------------------

def test_turns_go_round_by_round_and_each_contains_the_previous_one() -> None:
    turns = conversation_turns(CHAT, seed=1, words=WORDS)
    assert [(t.conversation, t.turn) for t in turns] == \
        [(c, k) for k in range(3) for c in range(3)]
    by = {(t.conversation, t.turn): t for t in turns}
    for c in range(3):
        for k in range(1, 3):
            prev, cur = by[c, k - 1], by[c, k]
            # the next prompt is the previous prompt, its reply and a follow-up
            assert cur.prompt.startswith(prev.prompt + prev.reply + "\nUser: ")
            assert cur.prompt.endswith("\nAssistant:")
            follow_up = cur.prompt[len(prev.prompt) + len(prev.reply) + 7:-len("\nAssistant:")]
            assert len(follow_up.split()) == CHAT.user_len
    first = by[0, 0].prompt
    system, context = first.split("\n")[0], first.split("\n")[1]
    assert system.startswith("System: ") and len(system.split()) == 1 + CHAT.system_len
    assert context.startswith("User: ") and len(context.split()) == 1 + CHAT.context_len
    # one system prompt for all, each conversation its own opening message
    assert len({t.prompt.split("\n")[0] for t in turns}) == 1
    assert len({by[c, 0].prompt.split("\n")[1] for c in range(3)}) == 3
    assert all(len(t.reply.split()) == CHAT.reply_len for t in turns)


def test_the_models_replies_go_into_the_next_turns_prompt_as_answered() -> None:
    """With `answer`, each round's prompts go to it together and its texts follow them as they
    are (a completion starts with its own space)."""
    asked: list[list[str]] = []

    def answer(prompts: list[str]) -> list[str]:
        asked.append(prompts)
        return [f" answer {len(asked)}.{c}" for c in range(len(prompts))]

    turns = conversation_turns(CHAT, seed=1, words=WORDS, answer=answer)
    assert [len(r) for r in asked] == [3, 3, 3]
    by = {(t.conversation, t.turn): t for t in turns}
    for c in range(3):
        assert by[c, 1].reply == f" answer 2.{c}"
        assert by[c, 1].prompt.startswith(by[c, 0].prompt + f" answer 1.{c}\nUser: ")
        assert asked[1][c] == by[c, 1].prompt
    # the user messages are drawn as without answers: only the replies differ
    drawn = conversation_turns(CHAT, seed=1, words=WORDS)
    assert turns[0].prompt == drawn[0].prompt
    with pytest.raises(ValueError, match="2 replies for 3 prompts"):
        conversation_turns(CHAT, seed=1, words=WORDS, answer=lambda ps: ps[:2])


def test_turns_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    assert conversation_turns(CHAT, 3, WORDS) == conversation_turns(CHAT, 3, WORDS)
    assert conversation_turns(CHAT, 3, WORDS)[0].prompt != \
        conversation_turns(CHAT, 4, WORDS)[0].prompt


def test_routes_alternate_each_conversations_turns_and_split_each_round() -> None:
    spec = ConversationSpec(conversations=4, turns=5)
    turns = conversation_turns(spec, 0, WORDS)
    routes = alternating_instances(turns)
    where = {(t.conversation, t.turn): r for t, r in zip(turns, routes)}
    for c in range(4):
        assert all(where[c, k] != where[c, k + 1] for k in range(4))
    for k in range(5):
        assert sorted(where[c, k] for c in range(4)) == [0, 0, 1, 1]


def test_sharegpt_file_and_flags() -> None:
    turns = [Turn(0, 0, "System: a\nUser: b\nAssistant:", "c d")]
    assert sharegpt_entries(turns) == [{"id": "c0-t0", "conversations": [
        {"from": "human", "value": "System: a\nUser: b\nAssistant:"},
        {"from": "gpt", "value": "c d"}]}]
    args = sharegpt_args(Path("/x/f.json"), CHAT)
    # in file order, none dropped silently or repeated, exact answer lengths
    for flag in ("--disable-shuffle", "--no-oversample"):
        assert flag in args
    assert args[args.index("--sharegpt-output-len") + 1] == "4"
    assert args[args.index("--num-prompts") + 1] == "9"
    sp = SharedPrefixSpec(num_prefixes=3, prompts_per_prefix=2, prefix_len=256, suffix_len=32,
                          output_len=8)
    pr = prefix_repetition_args(sp)
    assert pr[pr.index("--dataset-name") + 1] == "prefix_repetition"
    assert pr[pr.index("--num-prompts") + 1] == "6" and sp.prompt_tokens == 288


def test_single_token_words_and_the_prompt_limit() -> None:
    def encode(text: str) -> list[int]:  # words with a digit split in two tokens
        return [1, 2] if any(ch.isdigit() for ch in text) else [1]

    words = [f"x{i}" for i in range(5)] + ["alpha", "beta", "alpha"] + \
        [w * 2 for w in "abcdefghijklmnop"]
    kept = single_token_words(words, encode)
    assert kept[:2] == ["alpha", "beta"] and len(kept) == 18 and "x1" not in kept
    with pytest.raises(ValueError, match="only 2 of"):
        single_token_words(["alpha", "beta"], encode)
    turns = conversation_turns(CHAT, 0, WORDS)
    assert check_prompt_tokens(turns, lambda t: len(t.split())) == \
        max(len(t.prompt.split()) for t in turns)
    with pytest.raises(ValueError, match="drops prompts over 1024"):
        check_prompt_tokens(turns, lambda t: 2000)


# ---- config ------------------------------------------------------------------------------------

def test_config_refuses_what_cannot_be_compared() -> None:
    with pytest.raises(ValueError, match="baseline"):
        ServeBenchConfig(systems=(HOST,))
    with pytest.raises(ValueError, match="unknown system"):
        ServeBenchConfig(systems=(BASELINE, "gpu"))
    with pytest.raises(ValueError, match="more than once"):
        ServeBenchConfig(scenarios=(SHARED_PREFIX, SHARED_PREFIX))
    with pytest.raises(ValueError, match="must exceed the concurrency"):
        ServeBenchConfig(conversation=ConversationSpec(conversations=4), concurrency=4)
    with pytest.raises(ValueError, match="request rate"):
        ServeBenchConfig(request_rate=float("inf"))
    cfg = ServeBenchConfig(scenarios=(SHARED_PREFIX,), conversation=ConversationSpec(
        conversations=2), concurrency=4)  # no conversations run: no such constraint
    assert cfg.instances(HOST) == 1


def test_which_system_runs_where_and_on_how_many_servers() -> None:
    cfg = ServeBenchConfig()
    assert [cfg.instances(s) for s in (BASELINE, HOST, HOST_DISK, HOST_REDIS, SPLIT_REDIS)] \
        == [2, 2, 1, 2, 2]
    assert not cfg.runs(HOST_DISK, TWO_INSTANCES) and cfg.runs(HOST_DISK, MULTI_TURN)
    # prefill-decode: one server doing both against a prefill and a decode server, only
    assert [s for s in cfg.systems if cfg.runs(s, PREFILL_DECODE)] == [BASELINE, SPLIT_REDIS]
    assert [s for s in cfg.systems if cfg.runs(SPLIT_REDIS, s)] == []
    assert [sc for sc in cfg.scenarios if cfg.runs(SPLIT_REDIS, sc)] == [PREFILL_DECODE]
    single = ServeBenchConfig(scenarios=(SHARED_PREFIX, MULTI_TURN))
    assert single.instances(HOST_REDIS) == 1 and not single.runs(HOST, TWO_INSTANCES)


def test_pool_holds_concurrency_requests_of_the_longest_kind() -> None:
    plan = pool_plan(1184, concurrency=4)  # 1184 + 8 tokens: 10 blocks of 128
    assert (plan.max_model_len, plan.kv_blocks) == (1280, 40)
    assert pool_plan(1184, 4, kv_blocks=12).kv_blocks == 12
    with pytest.raises(ValueError, match="cannot hold one request"):
        pool_plan(1184, 4, kv_blocks=9)


def test_each_systems_connector_config_is_one_kvport_accepts() -> None:
    cfg = ServeBenchConfig(host_bytes=1 << 30, disk_bytes=2 << 30)
    assert kv_transfer_config(cfg, BASELINE) is None
    redis = {"url": "redis://127.0.0.1:1/0", "tenant": "kvport-bench-serve-00"}
    for system, kw in ((HOST, {}), (HOST_DISK, {"disk_dir": "/tmp/d"}),
                       (HOST_REDIS, {"redis": redis})):
        ktc = kv_transfer_config(cfg, system, **kw)
        assert ktc is not None
        assert ktc["kv_connector_module_path"] == "kvport.vllm"
        config = KVTransferConfig.from_any(ktc)
        assert config is not None
        parsed = parse_extra_config(OffloadingConfig, config)
        assert parsed.cpu_bytes_to_use == 1 << 30
        tiers = [type(t).__name__ for t in parsed.secondary_tiers]
        assert tiers == {HOST: [], HOST_DISK: ["DiskTierConfig"],
                         HOST_REDIS: ["RedisTierConfig"]}[system]
    with pytest.raises(ValueError, match="disk directory"):
        kv_transfer_config(cfg, HOST_DISK)
    roles = [kv_transfer_config(cfg, SPLIT_REDIS, redis=redis, instance=i) for i in (0, 1)]
    assert [r["kv_role"] for r in roles if r is not None] == ["kv_producer", "kv_consumer"]
    timeouts = [r["kv_connector_extra_config"]["secondary_tiers"][0].get("lookup_timeout_ms")
                for r in roles if r is not None]
    assert timeouts == [None, 500.0]  # a decode server's miss is a whole prompt computed
    for ktc in roles:
        config = KVTransferConfig.from_any(ktc)
        assert config is not None
        assert [type(t).__name__ for t in parse_extra_config(
            OffloadingConfig, config).secondary_tiers] == ["RedisTierConfig"]
    with pytest.raises(ValueError, match="split\\+redis needs its Redis"):
        kv_transfer_config(cfg, SPLIT_REDIS)


# ---- vLLM's result, /metrics, ratios, targets, report -----------------------------------------

def _raw(ttfts: list[float], errors: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    errors = errors or [""] * len(ttfts)
    done = sum(1 for e in errors if not e)
    return {"completed": done, "failed": len(errors) - done, "duration": 10.0,
            "median_ttft_ms": 500.0, "p99_ttft_ms": 900.0, "p50_itl_ms": 40.0,
            "output_throughput": 12.5, "total_token_throughput": 300.0, "ttfts": ttfts,
            "errors": errors, "queue_times": [0.1] * len(ttfts),
            "input_lens": [100] * len(ttfts), **kw}


def test_client_figures_take_vllms_numbers_and_ttft_after_the_first_turn() -> None:
    raw = _raw([5.0, 6.0, 0.2, 0.4, 0.0], ["", "", "", "", "Traceback...\nTimeoutError: x"])
    f = client_figures(raw, turns=[0, 0, 1, 1, 1])
    assert (f.ttft_p50_s, f.ttft_p99_s, f.itl_p50_s) == (0.5, 0.9, 0.04)
    assert f.ttft_p50_after_first_turn_s == pytest.approx(0.3)  # the failed one left out
    assert (f.requests, f.completed, f.failed) == (5, 4, 1)
    assert f.first_error == "TimeoutError: x" and f.client_queue_p50_s == pytest.approx(0.1)
    assert client_figures(raw, turns=None).ttft_p50_after_first_turn_s is None
    with pytest.raises(ValueError, match="dataset has 2 rows"):
        client_figures(raw, turns=[0, 1])


PROM = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits.
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 512.0
vllm:kvport_hit_tokens_total{engine="0",model_name="m",tier="host"} 384.0
vllm:kvport_hit_tokens_total{engine="0",model_name="m",tier="redis"} 128.0
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
garbage line
"""


def test_metrics_counters_their_change_and_where_tokens_came_from() -> None:
    before = counter_values(parse_prometheus(PROM.replace("1000.0", "100.0")
                                             .replace("384.0", "0.0")))
    after = counter_values(parse_prometheus(PROM))
    assert after["vllm:kvport_hit_tokens_total{tier=host}"] == 384.0
    assert "vllm:gpu_cache_usage_perc" not in after  # a gauge, not a counter of the run
    delta = counter_delta(before, after)
    assert delta["vllm:prefix_cache_queries_total"] == 900.0
    hits = hit_summary(sum_deltas([delta, delta]))
    assert hits.prompt_tokens == 1800 and hits.tier_hit_tokens == {"host": 768, "redis": 0}
    assert hits.computed_tokens == 1800 and hits.preemptions == 0
    whole = hit_summary(after)
    assert (whole.device_hit_tokens, whole.connector_hit_tokens, whole.computed_tokens) == \
        (200, 512, 288)


def _run(scenario: str, system: str, ttft: float, total: float, failed: int = 0,
         after_first: float | None = None) -> RunResult:
    raw = _raw([ttft] * 4, ["x"] * failed + [""] * (4 - failed), median_ttft_ms=ttft * 1000,
               total_token_throughput=total, output_throughput=total / 10)
    turns = [0, 0, 1, 1]
    figures = client_figures(raw, turns if after_first is not None else None)
    if after_first is not None:
        import dataclasses
        figures = dataclasses.replace(figures, ttft_p50_after_first_turn_s=after_first)
    hits = hit_summary({"vllm:prefix_cache_queries_total": 100.0,
                        "vllm:external_prefix_cache_hits_total": 50.0,
                        "vllm:kvport_hit_tokens_total{tier=host}": 50.0})
    return RunResult(scenario, system, 2 if scenario == TWO_INSTANCES else 1, figures, hits,
                     {}, [2, 2] if scenario == TWO_INSTANCES else None, 0.1, raw)


def _split_run(decode_computed: int) -> RunResult:
    """split+redis over 4 requests: the prefill server computed 2000 prompt tokens, the decode
    server `decode_computed` of its 2048."""
    import dataclasses
    run = _run(PREFILL_DECODE, SPLIT_REDIS, 1.0, 90.0)
    prefill = hit_summary({"vllm:prefix_cache_queries_total": 2000.0})
    decode = hit_summary({"vllm:prefix_cache_queries_total": 2048.0,
                          "vllm:external_prefix_cache_hits_total": 2048.0 - decode_computed})
    return dataclasses.replace(run, instances=2, instance_hits=[prefill, decode],
                               prefill_p50_s=0.8)


def _runs(**failed: int) -> list[RunResult]:
    return [_run(SHARED_PREFIX, BASELINE, 2.0, 100.0),
            _run(SHARED_PREFIX, HOST, 0.3, 150.0, failed.get("host", 0)),
            _run(TWO_INSTANCES, BASELINE, 3.0, 100.0, after_first=3.0),
            _run(TWO_INSTANCES, HOST, 1.0, 120.0, after_first=1.2),
            _run(TWO_INSTANCES, HOST_REDIS, 0.5, 200.0, after_first=0.3),
            _run(PREFILL_DECODE, BASELINE, 1.5, 100.0), _split_run(4 * 100)]


def test_ratios_and_the_targets_verdicts() -> None:
    runs = _runs()
    assert ratios(runs, runs[1])["ttft_p50_s"] == pytest.approx(0.15)
    got = {(v.target.scenario, v.target.metric): v for v in evaluate_targets(runs)}
    assert len(got) == len(TARGETS)
    assert got[SHARED_PREFIX, "ttft_p50_s"].met is True  # 0.15 <= 0.2
    assert got[SHARED_PREFIX, "output_tokens_per_s"].met is True  # 1.5 >= 1
    assert got[TWO_INSTANCES, "ttft_p50_after_first_turn_s"].ratio == pytest.approx(0.25)
    total = got[TWO_INSTANCES, "total_tokens_per_s"]  # against host, not no-connector
    assert total.ratio == pytest.approx(200 / 120) and total.met is False
    assert "NOT met" in verdict_line(total)
    unjudged = {v.target.metric: v for v in evaluate_targets(_runs(host=1))
                if v.target.scenario == SHARED_PREFIX}
    assert unjudged["ttft_p50_s"].met is None
    assert "not judged" in verdict_line(unjudged["ttft_p50_s"])
    only_shared = evaluate_targets(runs[:1])  # host absent: not measured
    assert [v.met for v in only_shared] == [None, None]
    split = got[PREFILL_DECODE, "decode_computed_prompt_tokens_per_request"]
    assert split.ratio == pytest.approx(100) and split.met is True  # <= one block of 128
    assert verdict_line(split).endswith("100.0 <= 128: met")
    (worse,) = evaluate_targets([_split_run(4 * 200)])
    assert worse.ratio == pytest.approx(200) and worse.met is False


def _result(runs: list[RunResult]) -> ServeBenchResult:
    return ServeBenchResult(
        params=ServeBenchConfig().params(), model_dir="/m",
        pool={"block_tokens": 128, "kv_blocks": 40, "working_set_blocks": {SHARED_PREFIX: 64}},
        machine={"cpu_count": 2}, vllm_version="0.32.0", runs=runs, servers=[], redis=None,
        wall_s=12.0, notes=["a note"])


def test_the_table_and_the_json(tmp_path: Path) -> None:
    result = _result(_runs())
    text = format_result(result)
    assert "TTFT p50 t>1" in text and "2x host+redis" in text and "note: a note" in text
    row = next(line for line in text.splitlines() if line.split()[:2] == ["shared-prefix", "host"])
    assert "0.300" in row and "0.15" in row and "host 50%" in row
    data = json.loads(json.dumps(result.to_json()))
    assert data["runs"][1]["ratio_vs_no_connector"]["ttft_p50_s"] == pytest.approx(0.15)
    assert data["runs"][1]["vllm_bench_serve"]["median_ttft_ms"] == 300.0
    assert {t["metric"] for t in data["targets"]} == {t.metric for t in TARGETS}
    split = data["runs"][-1]
    assert split["decode_computed_prompt_tokens_per_request"] == pytest.approx(100)
    assert split["instance_hits"][1]["computed_tokens"] == 400 and split["prefill_p50_s"] == 0.8
    assert "2x split+redis" in text
    require("matplotlib", "matplotlib is in the test extra: pip install 'kvport[test]'")
    plot_result(data, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_refuses_bad_flags_before_starting_anything(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["bench", "serve", "--systems", "host"]) == 2
    assert "baseline" in capsys.readouterr().err
    assert main(["bench", "serve", "--scenarios", "chat"]) == 2
    assert "unknown scenario" in capsys.readouterr().err
    assert main(["bench", "serve", "--redis-url", "http://127.0.0.1:1"]) == 2
    assert "redis:// or rediss://" in capsys.readouterr().err
    import shutil
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "redis-server"
                        else which(name))
    assert main(["bench", "serve", "--scenarios", "two-instances"]) == 2
    assert "install redis-server" in capsys.readouterr().err


# ---- the forwarder ---------------------------------------------------------------------------

class _Backend:
    """A stdlib HTTP server that streams two chunks; the second only after `release` is set.
    With a `status` other than 200 it answers that, with a JSON error, at once."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name = name
        self.seen: list[tuple[str, str | None, bytes]] = []
        self.release = threading.Event()
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                backend.seen.append((self.path, self.headers.get("x-request-id"), body))
                if status != 200:
                    error = b'{"error": "no"}'
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for part in (f"data: {backend.name} first\n\n", "data: [DONE]\n\n"):
                    data = part.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    backend.release.wait(timeout=30)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def backends() -> Iterator[list[_Backend]]:
    pair = [_Backend("zero"), _Backend("one")]
    yield pair
    for b in pair:
        b.close()


def test_route_of_reads_the_row_from_the_request_id() -> None:
    assert route_of("p-2", "p-", [0, 1, 1]) == 1
    assert [route_of(x, "p-", [0, 1, 1]) for x in (None, "q-1", "p-x", "p-9")] == [0, 0, 0, 0]


def test_forwarder_routes_by_row_and_relays_each_chunk_as_it_comes(
        backends: list[_Backend]) -> None:
    with Forwarder([b.port for b in backends], routes=[1, 0, 1], id_prefix="p-") as fwd:
        host, port = fwd.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", body=b'{"prompt": "hi"}',
                     headers={"x-request-id": "p-0", "Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200 and reply.getheader("Content-Type") == "text/event-stream"
        # the first chunk arrives while the server still holds the second one back
        assert reply.read1(65536) == b"data: one first\n\n"
        backends[1].release.set()
        assert reply.read() == b"data: [DONE]\n\n"
        backends[0].release.set()
        for request_id in ("p-1", "p-2"):  # the same keep-alive connection
            conn.request("POST", "/v1/completions", body=b"{}",
                         headers={"x-request-id": request_id})
            conn.getresponse().read()
        conn.close()
        assert fwd.counts == [1, 2]
    assert backends[1].seen[0] == ("/v1/completions", "p-0", b'{"prompt": "hi"}')
    assert [s[1] for s in backends[0].seen] == ["p-1"]
    assert [s[1] for s in backends[1].seen] == ["p-0", "p-2"]
    with pytest.raises(ValueError, match="outside 0..1"):
        Forwarder([1, 2], routes=[0, 2], id_prefix="p-")


def _post(url: str, request_id: str, body: bytes) -> http.client.HTTPResponse:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=body,
                 headers={"x-request-id": request_id, "Content-Type": "application/json"})
    return conn.getresponse()


def test_a_split_forwarder_prefills_one_token_first_then_streams_the_decode(
        backends: list[_Backend]) -> None:
    ask = {"prompt": "hi", "max_tokens": 8, "stream": True,
           "stream_options": {"include_usage": True}}
    backends[0].release.set()  # the prefill answers whole
    with Forwarder([b.port for b in backends], [1, 1], "p-", prefill=0) as fwd:
        reply = _post(fwd.url, "p-0", json.dumps(ask).encode())
        assert reply.status == 200
        # the decode server streams to the client; the prefill answer was taken whole before
        assert reply.read1(65536) == b"data: one first\n\n"
        assert len(backends[0].seen) == 1 and len(backends[1].seen) == 1
        backends[1].release.set()
        assert reply.read() == b"data: [DONE]\n\n"
        assert fwd.counts == [1, 1] and len(fwd.prefill_s) == 1
    prefilled = json.loads(backends[0].seen[0][2])
    assert prefilled == {"prompt": "hi", "max_tokens": 1, "stream": False}
    assert json.loads(backends[1].seen[0][2]) == ask  # the decode gets the request as sent
    with pytest.raises(ValueError, match="prefill names instance 2"):
        Forwarder([1, 2], [1], "p-", prefill=2)


def test_a_failed_prefill_is_the_clients_answer_and_nothing_is_decoded() -> None:
    failing, decode = _Backend("zero", status=500), _Backend("one")
    try:
        with Forwarder([failing.port, decode.port], [1], "p-", prefill=0) as fwd:
            reply = _post(fwd.url, "p-0", b'{"prompt": "hi"}')
            assert (reply.status, reply.read()) == (500, b'{"error": "no"}')
            assert fwd.counts == [1, 0]
        assert decode.seen == []
    finally:
        failing.close()
        decode.close()


# ---- servers: failures, deadlines, stopping the whole group ------------------------------------

def test_server_command_and_environment() -> None:
    spec = ServerSpec("host#0", "/models/m", "float32", 1280, 40, 4, 0,
                      {"kv_connector": "OffloadingConnector"}, threads=2)
    argv = server_argv(spec, 8123, python="py")
    assert argv[:5] == ["py", "-m", "kvport.vllm", "serve", "/models/m"]
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "41"  # plus the null block
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == spec.kv_transfer_config
    env = server_env(2, {"PYTHONPATH": "/elsewhere", "VLLM_SERVER_DEV_MODE": "0"})
    import kvport
    assert env["PYTHONPATH"].split(os.pathsep) == \
        [str(Path(kvport.__file__).resolve().parents[1]), "/elsewhere"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["OMP_NUM_THREADS"] == "2"


def test_the_last_error_of_a_vllm_log_loses_its_process_prefix() -> None:
    log = ("(APIServer pid=1) INFO 12-06 16:02:07 [api.py:1] starting\n"
           "(EngineCore pid=2) ERROR 12-06 16:02:41 [core.py:1512] AttributeError: 'X' has no "
           "attribute 'y'\n"
           "(APIServer pid=1) vllm.v1.engine.exceptions.EngineDeadError: see above\n")
    assert server_last_error(log) == "AttributeError: 'X' has no attribute 'y'"
    assert server_last_error("all good\n") is None


def _fake_server(tmp_path: Path, code: str, name: str = "fake") -> ServerProcess:
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    return ServerProcess(name, 1, [sys.executable, str(script)], dict(os.environ),
                         tmp_path / f"{name}.log")


def test_a_server_that_fails_to_start_reports_its_last_error(tmp_path: Path) -> None:
    server = _fake_server(tmp_path, "print('loading')\nraise ValueError('no such model: m')\n")
    with pytest.raises(ServerFailed, match="exited with code 1") as failed:
        server.wait_ready(deadline_s=120)
    assert failed.value.reason == "ValueError: no such model: m"
    assert "loading" in str(failed.value)  # the log's tail comes with it
    server.stop()
    server.stop()  # idempotent


def test_a_server_not_ready_by_its_deadline_is_stopped_with_its_whole_group(
        tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = (  # a server that forks a helper (vLLM's engine core) and never answers /health
        "import subprocess, sys, threading\n"
        "child = subprocess.Popen([sys.executable, '-c',\n"
        "                          'import threading; threading.Event().wait()'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('engine started', flush=True)\n"
        "threading.Event().wait()  # hangs until stopped\n")
    server = _fake_server(tmp_path, code)
    from polling import poll_until
    poll_until(lambda: pid_file.exists() and pid_file.read_text() != "", "the helper started",
               60, interval_s=0.01)
    with pytest.raises(ServerFailed, match="was not ready within 0 s"):
        server.wait_ready(deadline_s=0)
    child = int(pid_file.read_text())
    server.stop()
    # the helper, in the server's process group, went with it
    poll_until(lambda: not _alive(child), "the helper is gone", 30, interval_s=0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"  # a zombie waits for its parent, it does not run


def test_sigterm_interrupts_like_ctrl_c() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs as this call returns
    assert signal.getsignal(signal.SIGTERM) == previous


# ---- the run's Redis keys ----------------------------------------------------------------------

def test_only_the_runs_own_redis_keys_are_deleted(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.set(b"kvport:kvport-bench-serve-ab:0123:k1", b"ours")
    client.set(b"kvport:kvport-bench-serve-ab:0123:k2", b"ours")
    client.set(b"kvport:kvport-bench-serve-abc:0123:k", b"another run's")
    client.set(b"kvport:0123:k", b"no tenant")
    client.set(b"unrelated", b"x")
    tier = RedisTier(redis_server.url, "kvport-bench-serve-ab", started_by_bench=False)
    assert tier.entry() == {"url": redis_server.url, "tenant": "kvport-bench-serve-ab"}
    tier.delete_keys()
    tier.delete_keys()  # idempotent
    assert tier.deleted == 2 and tier.to_json()["keys_deleted"] == 2
    assert sorted(client.keys("*")) == [b"kvport:0123:k", b"kvport:kvport-bench-serve-abc:0123:k",
                                        b"unrelated"]
