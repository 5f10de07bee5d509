"""`kvport bench transfer` on tiny sizes: the harness runs and reports every field (not timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvport.bench.cli import main
from kvport.bench.transfer import TransferBenchConfig, format_transfer, run_transfer


def test_run_transfer_reports_host_and_disk_rows(tmp_path: Path) -> None:
    cfg = TransferBenchConfig(block_sizes=(32768, 65536), total_mib=1, repeats=1, disk_mib=1,
                              disk_dir=str(tmp_path), job_blocks=4)
    result = run_transfer(cfg)
    assert [r["offload_block_bytes"] for r in result["host"]] == [32768, 65536]
    for row in result["host"]:
        for strategy in cfg.strategies:
            assert row[strategy]["store_gib_s"] > 0 and row[strategy]["load_ratio"] > 0
    assert result["chosen_offload_block_bytes"] in (32768, 65536)
    for row in result["disk"]:
        assert row["tier_stats"]["failures"] == 0
        assert row["warm"]["tier_gib_s"] > 0 and row["cold"]["one_file_gib_s"] > 0
    assert "disk    65536 B" in format_transfer(result)
    assert list(tmp_path.iterdir()) == []  # the bench cleans up its files


def test_default_sizes_double_up_to_2_mib() -> None:
    assert TransferBenchConfig().sizes() == [32768 << k for k in range(7)]
    assert TransferBenchConfig(geometry="smollm2-135m").sizes() == [737280, 1474560]
    with pytest.raises(ValueError, match=r"block sizes \[1000\]"):
        TransferBenchConfig(block_sizes=(1000,))


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert main(["bench", "transfer", "--block-sizes", "32768", "--total-mib", "1",
                 "--repeats", "1", "--no-disk", "--json", str(out)]) == 0
    assert "host tier" in capsys.readouterr().out
    assert json.loads(out.read_text())["host"][0]["offload_block_bytes"] == 32768
    assert main(["bench", "transfer", "--block-sizes", "1000", "--no-disk"]) == 2
