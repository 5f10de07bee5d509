"""The Redis tier in `kvport bench transfer` and in the workload benchmarks (`redis-cold-host`),
against a real redis-server (tests/redis_fixtures.py): sane rows, Redis hits, equal outputs, no
keys left behind by the transfer bench, and the CLI's errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from redis_fixtures import RedisServer

from kvport.bench.cli import add_bench_parser, main
from kvport.bench.transfer.config import TransferBenchConfig
from kvport.bench.transfer.report import format_transfer
from kvport.bench.transfer.run import run_transfer
from kvport.bench.workload import run as workload_run
from kvport.bench.workload.cli import workload_config
from kvport.bench.workload.config import DEFAULT_CONFIGS, REDIS_COLD, WorkloadBenchConfig
from kvport.bench.workload.plan import build_config_specs, plan_engine
from kvport.bench.workload.report import format_result
from kvport.bench.workload.run import run_workload_bench
from kvport.bench.workload.workloads import LongDocSpec, MultiTurnSpec

TINY = "builtin:tiny-llama"


def test_transfer_redis_rows_are_sane_and_leave_no_key(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.set("someone-elses-key", b"kept")  # a server we were pointed at: only ours go
    cfg = TransferBenchConfig(block_sizes=(32768, 65536), total_mib=1, repeats=2, disk=False,
                              job_blocks=4, redis_url=redis_server.url, redis_mib=1)
    run = run_transfer(cfg)
    result = run.to_json()
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
    assert "redis    65536 B x 16: store tier" in format_transfer(run)
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
    assert main(["bench", "long-doc", "--model", TINY, "--redis-url",
                 "redis://127.0.0.1:1/0"]) == 2
    assert "pip install 'kvport[redis]'" in capsys.readouterr().err


# ---- the workload benchmarks: redis-cold-host ---------------------------------------------------

MT = MultiTurnSpec(users=3, rounds=3, system_len=32, context_len=48, question_len=8,
                   answer_tokens=4)


def _redis_hit_tokens(config: dict[str, Any]) -> int:
    return int(config["metrics"]["connector"]["redis"]["hit_tokens"])


def test_long_doc_quick_repeats_come_from_redis_under_a_salt_of_the_run(
        redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--quick with tiny-llama (shorter documents, 2 queries each): every repeated query loads its
    document from Redis, the first ones find nothing, also when an earlier run's keys are still
    on the server (a salt per run), and the run deletes its own keys and no others."""
    # 1024 tokens: two of tiny-llama's default offload blocks (512 tokens, 1 MiB)
    args = ["bench", "long-doc", "--quick", "--model", TINY, "--doc-len", "1024", "--queries",
            "2", "--configs", "no-connector", "--redis-url", redis_server.url]
    # the first run leaves its keys behind (as a vLLM run does)
    monkeypatch.setattr(workload_run, "delete_redis_keys", lambda ours: None)
    assert main([*args, "--json", str(tmp_path / "first.json")]) == 0
    left = redis_server.client().dbsize()
    assert left >= 2 * 2  # 2 documents of 2 offload blocks (512 tokens) at least
    monkeypatch.undo()
    out = tmp_path / "second.json"
    assert main([*args, "--json", str(out)]) == 0  # equal outputs: the bench's own guard
    result = json.loads(out.read_text())
    assert [c["name"] for c in result["configs"]] == ["no-connector", "redis-cold-host"]
    redis_cold = result["configs"][1]
    assert redis_cold["resets_unsupported"] == 0
    first = [r for r in redis_cold["per_request"] if r["index"] == 0]
    repeats = [r for r in redis_cold["per_request"] if r["index"] >= 1]
    assert len(repeats) == 2 and all(r["num_external_tokens"] == 0 for r in first)
    assert all(r["num_external_tokens"] >= 1024 for r in repeats)
    # every token the connector loaded came from Redis (the host tier is dropped each phase)
    assert _redis_hit_tokens(redis_cold) == sum(r["num_external_tokens"] for r in repeats)
    assert redis_cold["tier_hit_rates"]["redis"] > 0 and redis_cold["bytes_loaded"]["redis"] > 0
    # the salts differ per run, and the second run deleted its own keys only
    salts = {json.loads((tmp_path / f).read_text())["configs"][1]["kv_transfer_config"]
             ["kv_connector_extra_config"]["secondary_tiers"][0]["tenant_salt"]
             for f in ("first.json", "second.json")}
    assert len(salts) == 2
    assert result["redis_keys_deleted"] == left  # the same documents: as many keys
    assert redis_server.client().dbsize() == left
    assert any(t["config"] == "redis-cold-host" for t in result["targets"])


def test_multi_turn_later_rounds_hit_redis(redis_server: RedisServer, tmp_path: Path) -> None:
    cfg = WorkloadBenchConfig("multi-turn", MT, model=TINY, concurrency=2,
                              configs=("no-connector", REDIS_COLD), redis_url=redis_server.url)
    # tiny-llama's KV is small: 1 MiB offload blocks would be longer than these prompts
    specs = build_config_specs(cfg, plan_engine(cfg), tmp_path, block_tokens=16)
    [tier] = specs[1].kv_transfer_config["kv_connector_extra_config"]["secondary_tiers"]
    assert tier["type"] == "redis" and tier["url"] == redis_server.url and tier["tenant_salt"]
    run = run_workload_bench(cfg, specs, progress=False)  # OutputMismatch if outputs differ
    result = run.to_json()
    redis_cold = {c["name"]: c for c in result["configs"]}[REDIS_COLD]
    # round 1: nothing in Redis yet (the salt is this run's); later rounds load from it (not
    # every request: one of a pair waits for what the other is promoting, then takes it from
    # the engine's own prefix cache)
    assert all(r["num_external_tokens"] == 0 for r in redis_cold["per_request"]
               if r["index"] == 0)
    assert sum(r["num_external_tokens"] for r in redis_cold["per_request"]) > 0
    assert _redis_hit_tokens(redis_cold) > 0
    assert "redis hit" in format_result(run)
    assert redis_server.client().dbsize() == 0 and result["redis_keys_deleted"] > 0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvport")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_workload_cli_adds_redis_cold_host_only_with_a_url(redis_server: RedisServer) -> None:
    assert workload_config(_parse(["bench", "multi-turn", "--model", TINY])).configs == \
        DEFAULT_CONFIGS
    cfg = workload_config(_parse(["bench", "long-doc", "--model", TINY, "--redis-url",
                                   redis_server.url]))
    assert cfg.configs == (*DEFAULT_CONFIGS, REDIS_COLD) and cfg.redis_url == redis_server.url


def test_workload_cli_redis_errors(capsys: pytest.CaptureFixture[str],
                                   redis_server_factory: Any) -> None:
    tiny = ["--model", TINY, "--docs", "1", "--doc-len", "32", "--queries", "1"]
    assert main(["bench", "long-doc", *tiny, "--configs", "no-connector,redis-cold-host"]) == 2
    err = capsys.readouterr().err
    assert "'redis-cold-host' needs a Redis server: pass --redis-url redis://127.0.0.1:6379/0" \
        in err
    down = redis_server_factory(start=False)  # a free port nothing listens on
    assert main(["bench", "long-doc", *tiny, "--redis-url", down.url]) == 2
    assert f"cannot reach Redis at {down.url}" in capsys.readouterr().err
    assert main(["bench", "multi-turn", "--model", TINY, "--redis-url", "localhost:6379"]) == 2
    assert "redis:// or rediss://" in capsys.readouterr().err
    with pytest.raises(ValueError, match="used by configuration 'redis-cold-host' only"):
        WorkloadBenchConfig("long-doc", LongDocSpec(), redis_url="redis://127.0.0.1:6379/0")
