"""Run mutants: a copy of src/ per job with a zygote each, one mutant at a time per copy."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tools.mutation import REPO, Mutant
from tools.mutation.zygote import MUTANT_LIMIT_S, Zygote


def check_applicable(mutants: list[Mutant]) -> list[str]:
    """Problems that make mutants inapplicable: missing files, old text not exactly once."""
    problems = []
    for m in mutants:
        path = REPO / m.path
        if not path.is_file():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        count = path.read_text().count(m.old)
        if count != 1:
            problems.append(f"{m.name}: its old text occurs {count} times in {m.path} (need 1)")
        if not m.tests:
            problems.append(f"{m.name}: no tests")
    return problems


def check_imports(src: Path, env: dict[str, str]) -> None:
    """The mutated copy is what the tests import, here and in a spawned worker process."""
    probe = ("import multiprocessing as mp, kvport\n"
             "def where(q):\n    import kvport; q.put(kvport.__file__)\n"
             "if __name__ == '__main__':\n"
             "    q = mp.get_context('spawn').Queue()\n"
             "    p = mp.get_context('spawn').Process(target=where, args=(q,)); p.start()\n"
             "    print(kvport.__file__); print(q.get(timeout=60)); p.join()\n")
    script = src.parent / "probe_imports.py"
    script.write_text(probe)
    out = subprocess.run([sys.executable, str(script)], check=False, env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    found = out.stdout.split()
    if out.returncode or len(found) != 2 or not all(f.startswith(str(src)) for f in found):
        raise SystemExit(f"mutation: the tests would not import the mutated copy under "
                         f"{src}: {out.stdout!r} {out.stderr[-1000:]!r}")


def run_mutant(m: Mutant, src: Path, zygote: Zygote) -> tuple[str, float, str]:
    """(outcome, seconds, the failure lines of the test run)."""
    target = src.parent / m.path
    original = target.read_text()
    target.write_text(original.replace(m.old, m.new, 1))
    start = time.monotonic()
    try:
        code, output = zygote.pytest(["-x", "-q", "-p", "no:cacheprovider", *m.tests])
    finally:
        target.write_text(original)
    seconds = time.monotonic() - start
    lines = output.strip().splitlines()
    failures = "\n".join(f"    {line}" for line in lines if line.startswith(("E ", "FAILED")))
    if code == 0:
        return "SURVIVED", seconds, ""
    if code == 1:  # tests ran and failed
        return "killed", seconds, failures
    if code == -signal.SIGALRM:  # they hung: the guard is what ended them
        return "killed", seconds, f"    (no result within {MUTANT_LIMIT_S} s: the tests hung)"
    tail = "\n".join(f"    {line}" for line in lines[-8:])
    return f"ERROR (pytest exit {code})", seconds, tail


def run(mutants: list[Mutant], jobs: int, why: bool) -> list[tuple[Mutant, str]]:
    """Each mutant's outcome, printed as it comes (with its failures when `why`)."""
    results: list[tuple[Mutant, str]] = []
    with tempfile.TemporaryDirectory(prefix="kvport-mutants-") as tmp, \
            contextlib.ExitStack() as zygotes:
        # One copy of src/ per job: a copy holds one mutant at a time, and a zygote forks
        # the copy's pytest runs.
        copies: queue.SimpleQueue[tuple[Path, Zygote]] = queue.SimpleQueue()
        for j in range(jobs):
            src = Path(tmp) / f"job{j}" / "src"
            shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
            env = {**os.environ, "PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1"}
            if jobs > 1:  # jobs side by side: one thread each, or the cores thrash
                env["OMP_NUM_THREADS"] = "1"
            check_imports(src, env)
            zygote = Zygote(env, src.parent, cwd=REPO)
            zygotes.callback(zygote.close)
            copies.put((src, zygote))

        def run_in_a_copy(m: Mutant) -> tuple[str, float, str]:
            src, zygote = copies.get()
            try:
                return run_mutant(m, src, zygote)
            finally:
                copies.put((src, zygote))

        with ThreadPoolExecutor(jobs) as pool:
            futures = {pool.submit(run_in_a_copy, m): m for m in mutants}
            for future in as_completed(futures):
                m = futures[future]
                outcome, seconds, details = future.result()
                results.append((m, outcome))
                print(f"{outcome:<9} {seconds:6.1f}s  {m.name}", flush=True)
                if details and (why or outcome != "killed"):
                    print(details, flush=True)
    return results
