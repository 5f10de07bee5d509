"""`kvport bench throughput`: the method's arithmetic, the prompts, the vLLM protocol, and one tiny
end-to-end run (kvport against transformers; vLLM is never started here)."""

from __future__ import annotations

import ast
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from needs import require

from kvport.bench.cli import main
from kvport.bench.common.models import prompt_sampler, resolve_model_dir, special_token_ids
from kvport.bench.throughput.config import Task, ThroughputConfig, make_tasks
from kvport.bench.throughput.run import SystemResult, summarize
from kvport.bench.throughput.systems import time_tasks
from kvport.bench.vllm.server import run_tasks as vllm_run_tasks

TINY = "builtin:tiny-llama"


def test_prompts_are_seeded_and_avoid_special_tokens() -> None:
    model_dir = resolve_model_dir(TINY)
    special = special_token_ids(model_dir)
    assert {256, 257, 258} <= special  # BOS, EOS, PAD of the tiny model
    a = prompt_sampler(model_dir, seed=3)(4, 50)
    b = prompt_sampler(model_dir, seed=3)(4, 50)
    assert a == b and prompt_sampler(model_dir, seed=4)(4, 50) != a
    assert [len(p) for p in a] == [50] * 4
    assert all(0 <= t < 320 and t not in special for p in a for t in p)


def test_decode_and_prefill_throughput_come_from_median_times() -> None:
    cfg = ThroughputConfig(models=(TINY,), batch_sizes=(1, 4), decode_tokens=11, prefill_len=100,
                           repeats=3, baselines=())
    times = [
        {"decode/b1/n1": 0.1, "decode/b1/nN": 1.1, "decode/b4/n1": 0.2, "decode/b4/nN": 2.2,
         "prefill": 0.5},
        {"decode/b1/n1": 0.3, "decode/b1/nN": 9.0, "decode/b4/n1": 0.2, "decode/b4/nN": 2.2,
         "prefill": 0.25},
        {"decode/b1/n1": 0.1, "decode/b1/nN": 1.1, "decode/b4/n1": 0.2, "decode/b4/nN": 2.2,
         "prefill": 0.2},
    ]
    rec = summarize(cfg, SystemResult("x", "ok"), times)
    got = rec.metrics()
    assert got["decode_b1"] == pytest.approx(1 * 10 / (1.1 - 0.1))  # the 9.0 outlier is ignored
    assert got["decode_b4"] == pytest.approx(4 * 10 / (2.2 - 0.2))
    assert got["prefill"] == pytest.approx(100 / statistics.median([0.5, 0.25, 0.2]))
    assert rec.decode[0].tn_s == [1.1, 9.0, 1.1]  # raw times are kept
    assert rec.decode[0].best_tokens_per_s == pytest.approx(10 / (1.1 - 0.1))  # best round
    assert rec.decode[1].best_tokens_per_s == pytest.approx(4 * 10 / (2.2 - 0.2))
    assert rec.prefill is not None and rec.prefill.best_tokens_per_s == pytest.approx(100 / 0.2)


def test_config_rejects_bad_values_by_name() -> None:
    with pytest.raises(ValueError, match="decode_tokens=1"):
        ThroughputConfig(decode_tokens=1)
    with pytest.raises(ValueError, match="repeats=0"):
        ThroughputConfig(repeats=0)
    with pytest.raises(ValueError, match="unknown baselines.*'sglang'"):
        ThroughputConfig(baselines=("transformers", "sglang"))
    with pytest.raises(ValueError, match="batch_sizes"):
        ThroughputConfig(batch_sizes=(0,))
    with pytest.raises(ValueError, match="'/nonexistent'"):
        resolve_model_dir("/nonexistent")


def test_tasks_time_every_shape_and_check_lengths() -> None:
    cfg = ThroughputConfig(batch_sizes=(1, 8), decode_tokens=64)
    keys = [(t.key, t.batch, t.max_tokens) for t in make_tasks(cfg)]
    assert keys == [("decode/b1/n1", 1, 1), ("decode/b1/nN", 1, 64), ("decode/b8/n1", 8, 1),
                    ("decode/b8/nN", 8, 64), ("prefill", 1, 1)]
    assert {t.max_tokens for t in make_tasks(cfg, max_tokens_cap=8)} == {1, 8}
    sets = {"s": [[1, 2], [3, 4]]}
    task = Task("k", "s", batch=2, max_tokens=3, keep_output=True)
    out = time_tasks(lambda ps, n: [[7] * n for _ in ps], sets, [task])
    assert out.outputs == {"k": [[7, 7, 7], [7, 7, 7]]} and out.times["k"] >= 0
    with pytest.raises(RuntimeError, match="task k: got lengths \\[2, 2\\], expected 3"):
        time_tasks(lambda ps, n: [[7] * (n - 1) for _ in ps], sets, [task])


def test_vllm_server_runs_tasks_with_vllm_shaped_objects() -> None:
    """The server half against stand-ins for vLLM's LLM, SamplingParams and TokensPrompt."""

    class Params:
        def __init__(self, **kw: Any) -> None:
            self.kw = kw

    class Out:
        def __init__(self, ids: list[int]) -> None:
            self.outputs = [type("C", (), {"token_ids": ids})()]

    class FakeLLM:
        def generate(self, prompts: list[dict[str, Any]], params: Params,
                     use_tqdm: bool) -> list[Out]:
            assert params.kw == {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
            return [Out(p["prompt_token_ids"][:2]) for p in prompts]

    task = Task("k", "s", batch=1, max_tokens=2, keep_output=True).to_json()  # as sent
    out = vllm_run_tasks(FakeLLM(), Params, dict, {"s": [[5, 6, 7]]}, [task])
    assert out["outputs"] == {"k": [[5, 6]]}


def _imported(tree: ast.AST) -> list[str]:
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    return names + [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]


def test_the_vllm_server_never_imports_kvport() -> None:
    """The server runs under vLLM's own interpreter, where kvport may not be installed."""
    import kvport.bench.vllm.server as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    assert not [n for n in _imported(tree) if n.split(".")[0] == "kvport"]


def test_missing_transformers_gives_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvport.bench.throughput.hf import HFSystem

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(RuntimeError, match=r"kvport\[bench\]"):
        HFSystem(resolve_model_dir(TINY), "float32")


def test_end_to_end_tiny_run_writes_the_documented_schema(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    require("transformers", "transformers is in the test extra: pip install 'kvport[test]'")
    out = tmp_path / "result.json"
    rc = main(["bench", "throughput", "--model", TINY, "--batch-sizes", "1,2", "--prompt-len", "8",
               "--decode-tokens", "16", "--prefill-len", "32", "--repeats", "1",
               "--baselines", "transformers,vllm", "--vllm-python", str(tmp_path / "no-python"),
               "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "throughput"
    assert result["config"]["batch_sizes"] == [1, 2] and result["config"]["repeats"] == 1
    for key in ("cpu_model", "cpu_count", "torch_threads", "torch_version", "transformers_version"):
        assert key in result["machine"]
    (model,) = result["models"]
    systems = {s["system"]: s for s in model["systems"]}
    assert set(systems) == {"kvport", "transformers", "vllm"}
    assert systems["vllm"]["status"] == "skipped" and "no-python" in systems["vllm"]["reason"]
    for name in ("kvport", "transformers"):
        s = systems[name]
        assert s["status"] == "ok" and s["threads"] == result["machine"]["torch_threads"]
        assert [d["batch"] for d in s["decode"]] == [1, 2]
        # With one repeat of a few milliseconds, noise can make t(N) <= t(1): then None, not a
        # negative or infinite throughput.
        assert all(len(d["t1_s"]) == len(d["tn_s"]) == 1 for d in s["decode"])
        assert all(d["tokens_per_s"] is None or d["tokens_per_s"] > 0 for d in s["decode"])
        assert s["prefill"]["prompt_len"] == 32 and s["prefill"]["tokens_per_s"] > 0
        assert set(s["ratio_to_transformers"]) == {"decode_b1", "decode_b2", "prefill"}
        (load,) = s["other_load"]
        assert load is None or load >= 0.0
    assert systems["kvport"]["settings"]["enable_prefix_caching"] is False
    assert 0.0 <= systems["kvport"]["greedy_agreement"] <= 1.0
    ceil = model["ceilings"]
    assert ceil["read_gb_s"] > 0 and ceil["mm_gflop_s"]["float32"] > 0
    assert set(ceil["metrics"]) == {"decode_b1", "decode_b2", "prefill"}
    # a batch-2 step reads the same weights as a batch-1 step: twice the tokens per second
    assert ceil["metrics"]["decode_b2"] == pytest.approx(2 * ceil["metrics"]["decode_b1"])
    table = capsys.readouterr().out
    assert "kvport" in table and "(1.00x)" in table and "vllm: skipped" in table
    assert "(ceiling)" in table and table.splitlines()[0].startswith("engine throughput")


def test_ceilings_count_every_weight_once_and_the_prefills_flops() -> None:
    from kvport.bench.throughput.floors import MachineLimits, model_cost
    from kvport.model.config import ModelConfig

    mc = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 100, "hidden_size": 8,
                              "intermediate_size": 12, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 1,
                              "head_dim": 4, "tie_word_embeddings": True})
    cost = model_cost(mc, torch.bfloat16, prefill_len=10)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 12  # qkv, o, gate/up and down
    assert cost.weight_bytes_per_step == (2 * per_layer + 100 * 8) * 2  # + the head, 2 bytes
    attention = 4 * 10 * 10 / 2 * 2 * 2 * 4
    assert cost.prefill_flops == 2 * 10 * per_layer * 2 + 2 * 100 * 8 + attention
    limits = MachineLimits(threads=2, read_gb_s=10.0, mm_gflop_s={"float32": 100.0})
    assert cost.decode_ceiling(4, limits) == pytest.approx(4 * 10e9 / cost.weight_bytes_per_step)
    assert cost.prefill_ceiling(limits, "float32") == pytest.approx(
        10 * 100e9 / cost.prefill_flops)


def test_connector_overhead_tiny_run(tmp_path: Path) -> None:
    from kvport.bench.cli import main as bench_main

    out = tmp_path / "overhead.json"
    assert bench_main(["bench", "connector-overhead", "--batch", "2", "--prompt-len", "8",
                       "--decode-tokens", "4", "--rounds", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    names = [s["name"] for s in result["systems"]]
    assert names == ["no-connector", "offloading-stores-no-hits", "noop-connector",
                     "noop-connector+recording"]
    assert result["systems"][0]["ratio_to_no_connector"] == 1.0
    assert all(s["decode_tokens_per_s"] > 0 for s in result["systems"])
    assert result["trace_lines_written"] > 0


def test_one_overhead_config_for_both_engines_with_each_engines_defaults() -> None:
    from kvport.bench.overhead.config import OverheadConfig

    kvport = OverheadConfig.for_engine("kvport", "builtin:tiny-llama")
    vllm = OverheadConfig.for_engine("vllm", "m", rounds=9, recorder=True)
    assert (kvport.engine, kvport.prompt_len, kvport.decode_tokens, kvport.rounds) == \
        ("kvport", 128, 128, 7)
    assert (vllm.engine, vllm.prompt_len, vllm.decode_tokens, vllm.rounds, vllm.recorder) == \
        ("vllm", 256, 256, 9, True)
    assert vllm.target == ("example-in-recorder-off", "example", 0.98)
    recording = OverheadConfig.for_engine("vllm", "m", recording=True)
    assert recording.target == ("example-in-recorder-recording", "example", 0.95)
    with pytest.raises(ValueError, match="pick one"):
        OverheadConfig("m", engine="vllm", recorder=True, recording=True)
    with pytest.raises(ValueError, match="engine must be one of .*'sglang'"):
        OverheadConfig.for_engine("sglang", "m")
    with pytest.raises(ValueError, match="decode_tokens must be >= 2, got 1"):
        OverheadConfig("m", decode_tokens=1)
