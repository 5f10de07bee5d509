"""`kvport bench soak`: the probes, the bounds of the report, and one short real soak (a child
process killed with SIGKILL and restarted on one disk root and a real redis-server that
evicts) whose figures must stay bounded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvport
from kvport.bench.soak.child import SoakWorkload
from kvport.bench.soak.probe import DiskUsage, ProcessSample, disk_usage, sample_process
from kvport.bench.soak.reference import Mismatch, ReferenceCheck, check_outputs
from kvport.bench.soak.report import format_soak
from kvport.bench.soak.result import Incarnation, SoakBounds, SoakResult, Tick, summarize

SRC = str(Path(kvport.__file__).resolve().parents[1])
MAX_BYTES = 3 << 20
SOAK_TIMEOUT_S = 170  # the short soak's whole command: 16 s of workload, starts, the reference


# ---- probes and the workload stream --------------------------------------------------------

def test_disk_usage_counts_a_run_once_for_all_its_names_and_sees_temp_files(
        tmp_path: Path) -> None:
    (tmp_path / "ab").mkdir()
    run = tmp_path / "ab" / "k1.kvb"
    run.write_bytes(b"x" * 1000)
    os.link(run, tmp_path / "ab" / "k2.kvb")  # a second key of the same run
    (tmp_path / ".run.host.123.4.0.tmp").write_bytes(b"y" * 10)
    os.symlink(run, tmp_path / "link.kvb")  # not a regular file: not counted
    use = disk_usage(tmp_path)
    assert (use.bytes, use.files, use.names, use.temp_files) == (1010, 2, 3, 1)
    assert disk_usage(tmp_path / "missing") == DiskUsage(0, 0, 0, 0, 0)


def test_sample_process_reads_a_live_process_and_none_for_a_dead_one() -> None:
    mine = sample_process(os.getpid())
    assert mine is not None and mine.rss_bytes > 0 and mine.fds >= 3 and mine.threads >= 1
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert sample_process(int(done.stdout)) is None  # exited and reaped


def test_the_workload_repeats_shared_prompts_across_restarts_and_never_a_unique_one() -> None:
    a, b = SoakWorkload(7, 0, 0.5), SoakWorkload(7, 1, 0.5)
    first = [a.next() for _ in range(300)]
    second = [b.next() for _ in range(300)]
    shared = {p.token_ids for p in first if p.kind == "shared"}
    assert shared & {p.token_ids for p in second if p.kind == "shared"}  # restarts hit them
    unique = [p.token_ids for p in first + second if p.kind == "unique"]
    assert len(unique) == len(set(unique)) > 100
    assert len({len(p.token_ids) for p in first}) > 20 and {p.max_tokens for p in first} == \
        {4, 8, 16}
    again = SoakWorkload(7, 0, 0.5)  # seeded: the same stream again
    assert [p.token_ids for p in first[:20]] == [again.next().token_ids for _ in range(20)]


def test_the_reference_finds_an_answer_that_differs_and_counts_failed_requests() -> None:
    from kvport import LLM, SamplingParams

    prompt = list(range(40, 90))
    llm = LLM("builtin:tiny-llama", block_size=16, num_kv_blocks=32, seed=0)
    try:
        right = list(llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0,
                                                            ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids)
    finally:
        llm.shutdown()
    wrong = right[:2] + [(right[2] + 1) % 256] + right[3:]
    records = [{"prompt": prompt, "max_tokens": 4, "output": out, "status": status,
                "prompt_kind": "shared", "incarnation": i}
               for i, (out, status) in enumerate(((right, "length"), (wrong, "length"),
                                                  ([], "ERROR")))]
    check = check_outputs(records, "builtin:tiny-llama", "float32", 16, 32, 1)
    assert (check.checked, check.distinct_prompts, check.failed_requests) == (2, 1, 1)
    assert [(m.incarnation, m.first_difference) for m in check.mismatches] == [(1, 2)]


# ---- the report's bounds (built from records, no process) ----------------------------------

def _metrics(disk_hits: int) -> dict[str, Any]:
    return {"connector": {"requests": {"num_queried_tokens": 100, "num_disk_hit_tokens":
                                       disk_hits}},
            "kv_transfer": {"num_bad_answers": 0, "num_hook_errors": 0}}


def _life(index: int, end: str, disk_hits: int = 32) -> Incarnation:
    return Incarnation(index=index, pid=100 + index, started_s=0.0, ready_s=1.0, startup_s=0.1,
                       ended_s=2.0, end=end, clean_exit=end == "stopped", requests=5,
                       metrics=_metrics(disk_hits))


def _tick(index: int, disk_bytes: int = 1000, fds: int = 10,
          temp_files: int = 0) -> Tick:
    return Tick(t_s=1.0, incarnation=index, ready=True,
                process=ProcessSample(rss_bytes=100 << 20, fds=fds, threads=4),
                disk=DiskUsage(disk_bytes, disk_bytes, 1, 1, temp_files), redis=None,
                step_ms=(1.0, 2.0), requests=3, metrics=_metrics(0))


def _summary(lives: list[Incarnation] | None = None, ticks: list[Tick] | None = None,
             reference: ReferenceCheck | None = None, final_temp: int = 0,
             bounds: SoakBounds = SoakBounds()) -> SoakResult:
    lives = lives if lives is not None else [_life(0, "killed"), _life(1, "stopped")]
    ticks = ticks if ticks is not None else [_tick(0), _tick(1)]
    reference = reference or ReferenceCheck(checked=10, distinct_prompts=4, mismatches=(),
                                            failed_requests=0)
    result = summarize({"kill_every_s": 1.0, "seed": 0, "disk_max_bytes": MAX_BYTES}, bounds,
                       MAX_BYTES, lives, ticks, reference,
                       DiskUsage(0, 0, 0, 0, final_temp), {}, 3.0)
    format_soak(result)  # the table renders whatever the figures
    return result


def test_a_healthy_run_holds_every_bound() -> None:
    result = _summary()
    assert result.ok and result.violations == () and result.kills == 1
    assert result.restarted_disk_hit_tokens == 32
    assert result.samples[1].hit_rate == 0.0
    written = result.to_json()  # what --out writes
    assert written["ok"] and written["samples"][1]["hit_rate"] == 0.0
    assert written["processes"][0]["rss_bytes"] == [100 << 20] * 3


def test_an_answer_that_differs_from_the_reference_fails_the_run() -> None:
    bad = Mismatch(1, "shared", 64, 4, 2, (1, 2, 3, 4), (1, 2, 9, 4), 48, 32, 0,
                   tuple(range(64)))
    result = _summary(reference=ReferenceCheck(10, 4, (bad,), 0))
    assert not result.ok and "1 of 10 answers differ" in result.violations[0]


def test_disk_use_above_max_bytes_plus_slack_fails_the_run() -> None:
    over = MAX_BYTES + SoakBounds().disk_slack_bytes + 1
    result = _summary(ticks=[_tick(0), _tick(1, disk_bytes=over)])
    assert result.violations == (f"disk bytes {over:g} > {MAX_BYTES + (64 << 10):g}",)
    assert _summary(ticks=[_tick(0), _tick(1, disk_bytes=over - 1)]).ok


def test_temp_files_after_the_last_stop_fail_the_run() -> None:
    result = _summary(final_temp=2)
    assert result.violations == ("2 temp files left after the last stop",)


def test_a_restart_without_disk_hits_or_a_run_without_kills_fails() -> None:
    no_hits = _summary(lives=[_life(0, "killed"), _life(1, "stopped", disk_hits=0)])
    assert no_hits.violations == ("no restarted process got a disk hit",)
    no_kill = _summary(lives=[_life(0, "stopped")], ticks=[_tick(0)])
    assert no_kill.violations == ("0 kills < 1",)


def test_a_process_that_crashed_fails_the_run() -> None:
    result = _summary(lives=[_life(0, "killed"), _life(1, "exited unexpectedly (1)")])
    assert result.violations == ("process 1 (pid 101): exited unexpectedly (1)",)


def test_descriptor_growth_beyond_its_bound_fails_the_run() -> None:
    ticks = [_tick(0, fds=10), _tick(1, fds=30)]
    assert _summary(ticks=ticks).ok  # not bounded unless asked
    result = _summary(ticks=ticks, bounds=SoakBounds(max_fd_growth=8))
    assert result.violations == ("fd growth 20 > 8",)


def test_the_command_exits_1_when_a_bound_breaks(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    from kvport.bench.cli import main
    from kvport.bench.soak import run

    broken = _summary(final_temp=1)
    monkeypatch.setattr(run, "run_soak", lambda cfg: broken)
    out = tmp_path / "r.json"
    assert main(["bench", "soak", "--duration", "1", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["violations"] == list(broken.violations)
    monkeypatch.setattr(run, "run_soak", lambda cfg: _summary())
    assert main(["bench", "soak", "--duration", "1"]) == 0
    assert main(["bench", "soak", "--duration", "0"]) == 2  # a bad value: its message, exit 2


# ---- one short soak, for real --------------------------------------------------------------

@pytest.fixture(scope="module")
def short_soak(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found on PATH: apt-get install -y redis-server",
                    pytrace=False)
    work = tmp_path_factory.mktemp("soak")
    out = work / "soak.json"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "kvport.cli", "bench", "soak", "--duration", "16",
         "--kill-every", "4", "--seed", "3", "--disk-mib", "3", "--work-dir", str(work / "w"),
         "--out", str(out), "--max-fd-growth", "16", "--max-thread-growth", "8",
         "--min-kills", "1"],
        capture_output=True, text=True, timeout=SOAK_TIMEOUT_S, check=False, env=env)
    text = done.stdout + done.stderr
    assert out.exists(), text[-3000:]
    return done.returncode, json.loads(out.read_text()), text


def test_short_soak_answers_equal_and_every_bound_holds(
        short_soak: tuple[int, dict[str, Any], str]) -> None:
    rc, result, text = short_soak
    assert result["violations"] == [], text[-3000:]
    assert rc == 0 and result["ok"]
    ref = result["reference"]
    assert ref["num_mismatches"] == 0 and ref["checked"] == result["requests"] > 50
    assert result["kills"] >= 1
    lives = result["processes"]
    assert all(p["end"] == "killed" for p in lives[:-1])
    assert lives[-1]["end"] == "stopped" and lives[-1]["clean_exit"]
    assert all(p["bad_answers"] == 0 and p["hook_errors"] == 0 for p in lives)


def test_short_soak_restarts_hit_disk_and_leave_no_temp_files(
        short_soak: tuple[int, dict[str, Any], str]) -> None:
    _, result, _ = short_soak
    lives = result["processes"]
    assert any(p["hit_tokens"]["disk"] > 0 for p in lives[1:])  # the cache survived a kill
    assert result["final_disk"]["temp_files"] == 0
    peak = result["max"]["disk_bytes"]
    # at capacity (evicting), never above it
    assert 0.5 * MAX_BYTES < peak <= MAX_BYTES + (64 << 10)
    assert all(p["disk_evictions"] for p in lives)
    assert result["end"]["redis_evicted_keys"] > 0  # Redis below the working set, evicting


def test_short_soak_descriptors_and_threads_do_not_grow_across_restarts(
        short_soak: tuple[int, dict[str, Any], str]) -> None:
    _, result, _ = short_soak
    live = [s for s in result["samples"] if s["ready"] and s["fds"] is not None]
    per_life: dict[int, list[dict[str, Any]]] = {}
    for s in live:
        per_life.setdefault(s["incarnation"], []).append(s)
    assert len(per_life) >= 2
    first = per_life[min(per_life)]
    for samples in per_life.values():
        assert max(s["fds"] for s in samples) <= max(s["fds"] for s in first) + 8
        assert max(s["threads"] for s in samples) <= max(s["threads"] for s in first) + 4
    assert result["growth"]["fds"] <= 16 and result["growth"]["threads"] <= 8
