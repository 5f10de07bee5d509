"""The timed part of `kvport bench throughput` on one model: every system started and warmed up
(one that cannot start is skipped, the others go on), then the rounds, each running every live
system's tasks in turn (A B C A B C ...), with the load other processes added per round."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvport.bench.common.machine import OtherLoadMeter
from kvport.bench.common.models import prompt_sampler
from kvport.bench.throughput.config import DEFAULT_VLLM_PYTHON, Task, ThroughputConfig, make_tasks
from kvport.bench.throughput.systems import KvportSystem, PromptSets, System

WARMUP_TOKENS = 8
Starter = tuple[str, Callable[[], System], list[Task]]  # (name, start, its tasks)


@dataclass(frozen=True)
class Measured:
    """What one system's rounds gave: seconds per task key per round, the last round's kept
    outputs, and the cores other processes kept busy per round."""

    name: str
    status: str  # "ok", "skipped" (could not start) or "failed" (broke while measured)
    reason: str | None = None
    version: str | None = None
    threads: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    rounds: tuple[dict[str, float], ...] = ()
    last_outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    other_load: tuple[float | None, ...] = ()


@dataclass
class _Book:
    """A system's record while it is measured (frozen as Measured at the end)."""

    name: str
    status: str
    reason: str | None = None
    system: System | None = None  # while it runs
    tasks: list[Task] = field(default_factory=list)
    rounds: list[dict[str, float]] = field(default_factory=list)
    last_outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    other_load: list[float | None] = field(default_factory=list)

    def frozen(self, started: System | None) -> Measured:
        if started is None:
            return Measured(self.name, self.status, self.reason)
        return Measured(self.name, self.status, self.reason, started.version, started.threads,
                        started.settings, tuple(self.rounds), self.last_outputs,
                        tuple(self.other_load))


def measure_systems(cfg: ThroughputConfig, spec: str, model_dir: Path,
                    say: Callable[[str], None]) -> list[Measured]:
    draw = prompt_sampler(model_dir, cfg.seed)
    sets = {"decode": draw(max(cfg.batch_sizes), cfg.prompt_len),
            "prefill": draw(1, cfg.prefill_len)}
    books: list[_Book] = []
    started: dict[str, System] = {}
    try:
        for name, start, tasks in _starters(cfg, spec, model_dir):
            say(f"[{spec}] starting {name}")
            try:
                system = _start(start, _warmup_tasks(cfg, tasks), sets)
            except Exception as exc:  # noqa: BLE001 - one that cannot run is reported, others go on
                books.append(_Book(name, "skipped", _reason(exc)))
                say(f"[{spec}] {name} skipped: {books[-1].reason}")
                continue
            books.append(_Book(name, "ok", system=system, tasks=tasks))
            started[name] = system
            if system.threads != torch.get_num_threads():
                say(f"[{spec}] warning: {name} runs {system.threads} threads, "
                    f"not {torch.get_num_threads()}")
        for r in range(cfg.repeats):
            for book in books:
                if book.system is not None:
                    _timed_round(book, sets)
            say(f"[{spec}] round {r + 1}/{cfg.repeats} done")
    finally:
        for book in books:
            if book.system is not None:
                book.system.close()
    return [book.frozen(started.get(book.name)) for book in books]


def _timed_round(book: _Book, sets: PromptSets) -> None:
    """One round of one system's tasks, booked; a system that breaks is closed and failed."""
    assert book.system is not None, f"{book.name} is not running"
    meter = OtherLoadMeter()
    try:
        meter.start()
        done = book.system.run_tasks(sets, book.tasks)
        book.other_load.append(meter.stop())
    except Exception as exc:  # noqa: BLE001 - reported; the others go on
        book.status, book.reason = "failed", _reason(exc)
        system, book.system = book.system, None
        system.close()
        return
    book.rounds.append(done.times)
    book.last_outputs = done.outputs


def _warmup_tasks(cfg: ThroughputConfig, tasks: list[Task]) -> list[Task]:
    """Every task shape of a system once, with few tokens."""
    keys = {t.key for t in tasks}
    return [t for t in make_tasks(cfg, WARMUP_TOKENS) if t.key in keys]


def _starters(cfg: ThroughputConfig, spec: str, model_dir: Path) -> list[Starter]:
    """(name, start, tasks) of every system to measure on one model, kvport first."""
    from kvport.config import EngineConfig

    tasks = make_tasks(cfg)
    default_budget = EngineConfig.max_num_batched_tokens
    budget = max(cfg.prefill_len, max(cfg.batch_sizes) * cfg.prompt_len, default_budget)
    common = {"max_model_len": cfg.max_model_len, "max_num_seqs": cfg.max_num_seqs}
    out: list[Starter] = [
        ("kvport", lambda: KvportSystem("kvport", spec, cfg.dtype, budget, **common), tasks)]
    if cfg.prefill_len > default_budget:
        # Measured for prefill only: that is where one chunk versus several matters.
        prefill_only = [t for t in tasks if t.key == "prefill"]
        out.append(("kvport-default-chunking",
                    lambda: KvportSystem("kvport-default-chunking", spec, cfg.dtype, None,
                                         **common), prefill_only))
    if "transformers" in cfg.baselines:
        from kvport.bench.throughput.hf import HFSystem

        out.append(("transformers", lambda: HFSystem(model_dir, cfg.dtype), tasks))
    if "vllm" in cfg.baselines:
        from kvport.bench.throughput.vllm import VllmSystem

        def start_vllm() -> System:
            if cfg.vllm_python is None:
                raise FileNotFoundError(f"no vLLM interpreter ({DEFAULT_VLLM_PYTHON} does not "
                                        "exist; pass --vllm-python)")
            return VllmSystem(cfg.vllm_python, model_dir, cfg.dtype, torch.get_num_threads(),
                              max_num_batched_tokens=budget, kv_space_gib=cfg.vllm_kv_space_gib,
                              **common)

        out.append(("vllm", start_vllm, tasks))
    return out


def _start(start: Callable[[], System], warmup: list[Task], sets: PromptSets) -> System:
    system = start()
    try:
        system.run_tasks(sets, warmup)
    except BaseException:
        system.close()
        raise
    return system


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()
