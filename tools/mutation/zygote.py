"""A zygote per copy of src/: one process that imported the third-party modules once and forks a
fresh child for each mutant's pytest run. Run as a script (`python zygote.py`), it serves; the
runner talks to it through `Zygote`. Standard library only, and nothing of the package: the
zygote starts from this file alone."""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

MUTANT_LIMIT_S = 240  # one mutant's test run at most (a hang counts as killed)

# Third-party modules the tests import, loaded once in each job's zygote. Without them a
# mutant's pytest run spends about 7 of its 9 seconds starting up (torch alone, with the
# torch._dynamo that torch.nn.attention pulls in, is 2-3 s); with them it forks ready.
PRELOAD = ("numpy", "torch", "torch.nn.functional", "torch.nn.attention.bias", "safetensors.torch",
           "tokenizers", "xxhash", "redis", "psutil", "pytest", "multiprocessing",
           "concurrent.futures", "ctypes", "mmap")  # not hypothesis: pytest rewrites its plugin


def serve() -> int:
    """Import PRELOAD, then for each request line on stdin (JSON: pytest args and a log path)
    fork a child that runs pytest with stdout and stderr in the log, and answer with its exit
    code. kvport itself is never imported here: each child imports the copy that holds its
    mutant (PYTHONPATH)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the tests that need it fail in the child, as they would without a zygote
    assert "kvport" not in sys.modules, "the zygote must not import kvport (the copies do)"
    # torch starts its thread pools at first use, not at import: nothing runs here yet, so a
    # fork copies a process with one thread.
    assert threading.active_count() == 1, f"zygote has threads: {threading.enumerate()}"
    # What is loaded now stays: a child's collections (pytest runs five at its end) skip it.
    gc.freeze()
    for line in sys.stdin:
        request = json.loads(line)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:  # the child: one pytest run, then out without the zygote's cleanup
            code = 3
            try:
                # A mutant whose tests hang (a loop its guard ended) is stopped, not waited on
                # forever: the default SIGALRM action ends the child (run_mutant: killed).
                signal.alarm(MUTANT_LIMIT_S)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                import pytest
                code = int(pytest.main(request["args"]))
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(log)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


class Zygote:
    """A serving zygote with one job's environment (its copy on PYTHONPATH)."""

    def __init__(self, env: dict[str, str], log_dir: Path, cwd: Path) -> None:
        self.log = log_dir / "pytest.log"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=cwd, text=True)

    def pytest(self, args: list[str]) -> tuple[int, str]:
        """pytest's exit code and output for args, run in a fresh fork."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"args": args, "log": str(self.log)}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"mutation: the zygote {self.proc.pid} died "
                             f"(exit {self.proc.wait()})")
        return int(json.loads(answer)["code"]), self.log.read_text(errors="replace")

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # this folder: its runner.py and zygote.py are no modules of the tests
    sys.exit(serve())
