"""The worker-process executor: one reader thread for the life of the engine, replies in order,
and a worker that dies fails the steps waiting on it instead of hanging the engine."""

from __future__ import annotations

import threading

import pytest

from kvport import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_no_thread_per_message(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("builtin:tiny-llama", block_size=4, max_model_len=64, worker="process",
              async_scheduling=True)
    started: list[str] = []
    original = threading.Thread.start

    def counting_start(self: threading.Thread) -> None:
        started.append(self.name)
        original(self)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    outs = llm.generate([[5] * 9, [7] * 11], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert llm.engine.scheduler.step_id >= 8  # many messages crossed the pipe ...
    ours = [name for name in started if not name.startswith("tqdm")]  # tqdm's own monitor
    assert ours == [], f"threads started per message: {ours[:5]}"  # ... no thread each
    llm.engine.check_no_leaks()
    llm.shutdown()


def test_a_dead_worker_fails_the_step_instead_of_hanging() -> None:
    llm = LLM("builtin:tiny-llama", block_size=4, max_model_len=64, worker="process")
    executor = llm.engine.executor
    executor._proc.kill()  # type: ignore[attr-defined]
    executor._proc.join()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="worker process died"):
        llm.generate([[5] * 9], GREEDY, use_tqdm=False)
    llm.shutdown()  # returns: nothing waits on the dead worker
