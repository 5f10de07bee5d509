"""The Redis tier in `kvport bench transfer` and in the workload benchmarks (`redis-cold-host`),
against a real redis-server (tests/redis_fixtures.py): sane rows, Redis hits, equal outputs, no
keys left behind by the transfer bench, and the CLI's errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from redis_fixtures import RedisServer

from kvport.bench.cli import main
from kvport.bench.transfer import TransferBenchConfig, format_transfer, run_transfer

TINY = "builtin:tiny-llama"


def test_transfer_redis_rows_are_sane_and_leave_no_key(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.set("someone-elses-key", b"kept")  # a server we were pointed at: only ours go
    cfg = TransferBenchConfig(block_sizes=(32768, 65536), total_mib=1, repeats=2, disk=False,
                              job_blocks=4, redis_url=redis_server.url, redis_mib=1)
    result = run_transfer(cfg)
    rows = result["redis"]["rows"]
    assert [r["offload_block_bytes"] for r in rows] == [32768, 65536]
    for row in rows:
        assert row["num_values"] * row["offload_block_bytes"] == row["bytes_per_transfer"] == 1 << 20
        for direction in ("store", "load"):
            d = row[direction]
            assert d["tier_gib_s"] > 0 and d["redis_py_gib_s"] > 0 and d["ratio"] > 0
            assert len(d["tier_s"]) == len(d["redis_py_s"]) == cfg.repeats
        stats = row["tier_stats"]
        # warm-up and timed rounds, every value each time, nothing failed
        assert stats["blocks_stored"] == stats["blocks_loaded"] == (cfg.repeats + 1) * \
            row["num_values"]
        assert stats["failures"] == stats["skipped_stores"] == stats["corrupt"] == 0
    assert result["redis"]["server"]["redis_version"]
    assert "redis    65536 B x 16: store tier" in format_transfer(result)
    assert client.keys("*") == [b"someone-elses-key"]


def test_transfer_cli_redis_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   redis_server: RedisServer) -> None:
    base = ["bench", "transfer", "--block-sizes", "32768", "--total-mib", "1", "--repeats", "1",
            "--no-disk", "--redis-mib", "1"]
    assert main([*base, "--redis-url", "http://127.0.0.1:1/0"]) == 2
    assert "redis:// or rediss://" in capsys.readouterr().err
    out = tmp_path / "t.json"
    assert main([*base, "--redis-url", redis_server.url, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["redis"]["rows"][0]["load"]["ratio"] > 0
    assert redis_server.client().dbsize() == 0
    redis_server.stop()
    assert main([*base, "--redis-url", redis_server.url]) == 2
    assert f"cannot reach Redis at {redis_server.url}" in capsys.readouterr().err


def test_benches_without_redis_py_say_how_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_redis(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "redis" else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_redis)
    assert main(["bench", "transfer", "--no-disk", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "pip install 'kvport[redis]'" in capsys.readouterr().err
