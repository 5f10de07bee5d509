"""`kvport bench transfer` on tiny sizes: the harness runs and reports every field (not timing)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvport.bench.cli import main
from kvport.bench.transfer.config import TransferBenchConfig
from kvport.bench.transfer.one_file import read_split
from kvport.bench.transfer.report import format_transfer
from kvport.bench.transfer.run import run_transfer
from kvport.bench.transfer.timing import HelperThread, paired_rounds


def test_run_transfer_reports_host_and_disk_rows(tmp_path: Path) -> None:
    cfg = TransferBenchConfig(geometry="tiny-llama", layout="kvport", total_mib=1, repeats=3,
                              disk_mib=1, disk_dir=str(tmp_path), small_job_blocks=4,
                              strategies=("numpy", "runs"))
    run = run_transfer(cfg)
    result = run.to_json()
    # one engine block (32 KiB) per offload block; a job of 1 MiB and jobs of 4 blocks, each
    # into consecutive and into scattered slots
    assert [(r["job_blocks"], r["num_jobs"], r["slots"]) for r in result["host"]] == [
        (32, 1, "consecutive"), (32, 1, "scattered"), (4, 8, "consecutive"),
        (4, 8, "scattered")]
    for row in result["host"]:
        assert row["offload_block_bytes"] == row["engine_block_bytes"] == 32768
        assert row["torch_copy_gib_s"] > 0
        for strategy in cfg.strategies:
            r = row[strategy]
            assert r["store_gib_s"] > 0 and r["load_ratio_min"] <= r["load_ratio"] \
                <= r["load_ratio_max"]
    assert [(r["offload_block_bytes"], r["job_blocks"]) for r in result["disk"]] == [
        (32768, 32), (32768, 4)]
    for row in result["disk"]:
        assert row["tier_stats"]["failures"] == 0
        assert row["warm"]["tier_gib_s"] > 0 and row["cold"]["one_file_gib_s"] > 0
        for extra in ("checked_file", "main_thread_file", "split_file"):  # beside the baseline
            assert row["warm"][f"{extra}_gib_s"] > 0 and row["warm"][f"ratio_to_{extra}"] > 0
        assert row["warm"]["read_threads"] == torch.get_num_threads()  # the tier's default
    assert result["disk"][0]["store"]["tier_gib_s"] > 0
    # the targets: consecutive host rows (2 job sizes x 2 strategies x store/load) and
    # every disk row (cold and warm), each with its limit
    targets = {t["what"]: t for t in result["targets"]}
    assert len(targets) == 2 * 2 * 2 + 2 * 2
    host = targets["host tiny-llama/kvport 32768 B, jobs of 4, numpy load"]
    assert host["limit"] == 0.9 and host["met"] == (host["ratio"] >= 0.9)
    assert host["ratio"] == result["host"][2]["numpy"]["load_ratio"]
    assert targets["disk 32768 B, jobs of 32, cold load"]["limit"] == 0.8
    assert not any("scattered" in w for w in targets)
    text = format_transfer(run)
    assert "disk    32768 B x 32, jobs of 4" in text and "tiny-llama/kvport" in text
    assert "target disk 32768 B, jobs of 4, warm load vs one file: " in text
    assert "warm one file read on the main thread" in text
    assert f"warm one file read in {torch.get_num_threads()} parts at once" in text
    assert f"targets met: {sum(t['met'] for t in targets.values())} of 12" in text
    assert result["other_load_cores"] >= 0.0 and result["steal_cores"] >= 0.0
    assert (f"other load during the run {result['other_load_cores']:.2f} cores, of which "
            f"hypervisor steal {result['steal_cores']:.2f}") in text
    assert list(tmp_path.iterdir()) == []  # the bench cleans up its files


def test_every_pool_case_by_default_one_engine_block_each() -> None:
    cfg = TransferBenchConfig()
    assert [(c.name, c.engine_block_bytes) for c in cfg.cases()] == [
        ("tiny-llama/kvport", 32768), ("smollm2-135m/kvport", 737280),
        ("tiny-llama/vllm-cpu", 262144), ("smollm2-135m/vllm-cpu", 5898240)]
    assert cfg.sizes() == [32768, 262144, 737280, 5898240]
    assert [cfg.offload_sizes(c) for c in cfg.cases()] == [[32768], [737280], [262144],
                                                          [5898240]]
    only = TransferBenchConfig(geometry="smollm2-135m", block_sizes=(737280, 1474560))
    assert [only.offload_sizes(c) for c in only.cases()] == [[737280, 1474560], []]
    with pytest.raises(ValueError, match=r"block sizes \[1000\]"):
        TransferBenchConfig(block_sizes=(1000,))
    with pytest.raises(ValueError, match="strategies"):
        TransferBenchConfig(strategies=("memcpy",))


def test_paired_rounds_rotate_the_order() -> None:
    order: list[str] = []
    times = paired_rounds({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                          repeats=3, before=lambda name: order.append(f"before {name}"),
                          warm_up=False)
    assert [len(t) for t in times.values()] == [3, 3]
    assert [o for o in order if not o.startswith("before")] == ["a", "b", "b", "a", "a", "b"]
    assert order[:2] == ["before a", "a"]


def test_helper_thread_runs_each_function_on_its_own_thread_and_reraises() -> None:
    helper = HelperThread()
    seen: list[str] = []
    helper.run(lambda: seen.append(threading.current_thread().name))
    helper.wrap(lambda: seen.append(threading.current_thread().name))()
    assert seen == ["kvport-bench-helper"] * 2

    def fails() -> None:
        raise OSError("injected")

    with pytest.raises(OSError, match="injected"):
        helper.run(fails)
    helper.run(lambda: seen.append("after"))  # the thread survives a failure
    assert seen[-1] == "after"
    helper.close()
    assert not helper._thread.is_alive()


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert main(["bench", "transfer", "--block-sizes", "32768", "--total-mib", "1",
                 "--repeats", "1", "--no-disk", "--small-job-blocks", "16", "--json",
                 str(out)]) == 0
    assert "host tier" in capsys.readouterr().out
    rows = json.loads(out.read_text())["host"]
    assert {(r["case"], r["offload_block_bytes"], r["job_blocks"]) for r in rows} == {
        ("tiny-llama/kvport", 32768, 32), ("tiny-llama/kvport", 32768, 16)}
    assert main(["bench", "transfer", "--block-sizes", "1000", "--no-disk"]) == 2
    assert main(["bench", "transfer", "--strategies", "bogus", "--no-disk"]) == 2


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_split_baseline_reads_the_whole_file(tmp_path: Path, k: int) -> None:
    """The split one-file read fills every byte, in whole entries per part (any part count)."""
    data = bytes(range(256)) * 7 * 5  # 5 entries of 1792 B
    path = tmp_path / "one.bin"
    path.write_bytes(data)
    out = bytearray(len(data))
    with ThreadPoolExecutor(max(1, k - 1)) as pool:
        read_split(path, memoryview(out), 1792, pool, k)
    assert bytes(out) == data
