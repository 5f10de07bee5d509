"""Benchmarks behind `kvport bench`: one module per subcommand, plus the facts they all record.

Every benchmark measures its baselines in the same run as kvport and reports ratios, because
absolute numbers on a shared, noisy machine mean little. Results go to JSON with `machine_info()`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol


def name_list(text: str) -> tuple[str, ...]:
    """A command-line list of names, comma-separated; "none" (or nothing) is the empty list."""
    return tuple(p.strip() for p in text.split(",") if p.strip() and p.strip() != "none")


def machine_info() -> dict[str, Any]:
    """CPU, cores, threads, load and library versions: what a reader needs to judge a number."""
    import torch  # here, so that `kvport bench --help` does not import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu_model": cpu, "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
        "python": sys.version.split()[0], "platform": platform.platform(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    for dist in ("kvport", "transformers"):
        try:
            info[f"{dist}_version"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[f"{dist}_version"] = None
    return info


def save_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def run_bench_command(name: str, json_path: str | None, make_config: Callable[[], Any],
                      run: Callable[[Any], dict[str, Any]],
                      fmt: Callable[[dict[str, Any]], str],
                      finish: Callable[[dict[str, Any]], int] | None = None) -> int:
    """The shape of every `kvport bench` subcommand: build the config (a bad value: exit 2 with
    its message), run, print the table, write --json, then `finish(result)` gives the exit code
    (default 0)."""
    try:
        cfg = make_config()
    except ValueError as exc:
        print(f"kvport bench {name}: {exc}", file=sys.stderr)
        return 2
    result = run(cfg)
    print(fmt(result))
    if json_path:
        save_json(result, json_path)
        print(f"wrote {json_path}")
    return finish(result) if finish is not None else 0


def resolve_model_dir(spec: str) -> Path:
    """`builtin:NAME` -> the Hugging Face-format directory kvport materializes for it (so that
    baselines load the very same weights); anything else must be such a directory."""
    if spec.startswith("builtin:"):
        from kvport.model.builtin import builtin_model_dir

        return Path(builtin_model_dir(spec.removeprefix("builtin:")))
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {spec!r}: neither 'builtin:NAME' nor a directory with config.json")
    return path


def special_token_ids(model_dir: Path) -> set[int]:
    """BOS/EOS/PAD/UNK of config.json plus every special added token of tokenizer.json."""
    config = json.loads((model_dir / "config.json").read_text())
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = config.get(key)
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    tok_file = model_dir / "tokenizer.json"
    if tok_file.is_file():
        added = json.loads(tok_file.read_text()).get("added_tokens", [])
        ids.update(t["id"] for t in added if t.get("special"))
    return ids


def prompt_sampler(model_dir: Path, seed: int) -> Callable[[int, int], list[list[int]]]:
    """`draw(n, length)`: n random prompts of non-special token ids, the same for a given seed.

    Random ids rather than text: every system sees exactly the same ids, no tokenizer involved.
    """
    import torch

    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    special = special_token_ids(model_dir)
    allowed = torch.tensor([i for i in range(vocab) if i not in special], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int, length: int) -> list[list[int]]:
        picks = torch.randint(len(allowed), (n, length), generator=gen)
        return allowed[picks].tolist()

    return draw


def time_tasks(generate: Callable[[list[list[int]], int], list[list[int]]],
               prompt_sets: dict[str, list[list[int]]],
               tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """Times `generate(prompts, max_tokens)` once per task, in order (task format: see
    `vllm_baseline`); checks that every prompt got exactly `max_tokens` tokens."""
    times: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    for task in tasks:
        prompts = prompt_sets[task["set"]][: task["batch"]]
        start = time.perf_counter()
        ids = generate(prompts, task["max_tokens"])
        times[task["key"]] = time.perf_counter() - start
        if len(ids) != len(prompts) or any(len(x) != task["max_tokens"] for x in ids):
            raise RuntimeError(f"task {task['key']}: got lengths {[len(x) for x in ids]}, "
                               f"expected {task['max_tokens']} for each of {len(prompts)} prompts")
        if task.get("keep_output"):
            outputs[task["key"]] = ids
    return {"times": times, "outputs": outputs}


class System(Protocol):
    """A system under test: runs a list of tasks (format: see `vllm_baseline`), timing each one.

    `threads` is the torch thread count it really runs with; `settings` what it was started with.
    """

    name: str
    version: str
    threads: int
    settings: dict[str, Any]

    def run_tasks(self, prompt_sets: dict[str, list[list[int]]],
                  tasks: list[dict[str, Any]]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class KvportSystem:
    """kvport's `LLM` as a system under test; prefix caching off, so every run computes."""

    def __init__(self, name: str, model: str, dtype: str, max_num_batched_tokens: int | None,
                 max_model_len: int, max_num_seqs: int) -> None:
        import torch

        import kvport
        from kvport import LLM, SamplingParams

        kwargs: dict[str, Any] = {"dtype": dtype, "enable_prefix_caching": False, "seed": 0,
                                  "max_model_len": max_model_len, "max_num_seqs": max_num_seqs}
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        self.name = name
        self.settings = kwargs
        self.version = kvport.__version__
        self.threads = torch.get_num_threads()
        self._params = SamplingParams
        self.llm = LLM(model=model, **kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def run_tasks(self, prompt_sets: dict[str, list[list[int]]],
                  tasks: list[dict[str, Any]]) -> dict[str, Any]:
        return time_tasks(self.generate, prompt_sets, tasks)

    def close(self) -> None:
        self.llm.shutdown()


class OtherLoadMeter:
    """How many cores other processes kept busy while we measured (Linux; else None).

    Busy CPU time of the whole machine (/proc/stat) minus that of this process and its children
    (a vLLM server included), divided by wall time. On a shared 2-core machine a timed round with
    other load near 1 is worth little; the JSON records it per round so readers can tell.
    `steal_cores` (after `stop`) is the part of it the hypervisor took: time our virtual CPUs
    were ready but not run. On the 2-vCPU VMs of BENCHMARKS.md it went from 0 to 0.3 of each
    core within a day, and runs with it are slower and noisier across the board.
    """

    def __init__(self) -> None:
        self._start: tuple[float, float, float, float] | None = None
        self.steal_cores: float | None = None

    def start(self) -> None:
        self._start = self._sample()
        self.steal_cores = None

    def stop(self) -> float | None:
        begin, end = self._start, self._sample()
        if begin is None or begin[0] < 0 or end[0] < 0:
            return None
        wall = end[2] - begin[2]
        if wall <= 0:
            return None
        self.steal_cores = max(0.0, (end[3] - begin[3]) / wall)
        other = (end[0] - begin[0]) - (end[1] - begin[1])
        return max(0.0, other / wall)

    @staticmethod
    def _sample() -> tuple[float, float, float, float]:
        """(machine busy CPU s, our process tree's CPU s, wall s, stolen CPU s); -1 s when
        /proc is missing."""
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return (-1.0, 0.0, time.monotonic(), 0.0)
        ticks = os.sysconf("SC_CLK_TCK")
        busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4))  # not idle/iowait
        steal = int(fields[7]) if len(fields) > 7 else 0
        return (busy / ticks, _tree_cpu_ticks(os.getpid()) / ticks, time.monotonic(),
                steal / ticks)


def _tree_cpu_ticks(root: int) -> int:
    """utime + stime of `root` and its live descendants (plus children already reaped)."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, ticks)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # the process ended meanwhile
            stats[int(entry.name)] = (int(rest[1]), sum(int(v) for v in rest[11:15]))
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in tree]
        tree.update(kids)
        frontier.extend(kids)
    # fields 11-14 are utime, stime, cutime, cstime: children reaped earlier count as ours
    return sum(stats[pid][1] for pid in tree if pid in stats)
