"""Suite-wide fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Real redis-server fixtures (tests/ is on sys.path: pyproject's pythonpath = ["tests"]).
pytest_plugins = ["redis_fixtures"]

# Deterministic by default (the same examples on every run, as CI needs); set
# KVPORT_HYPOTHESIS=explore to draw new examples each run while hunting bugs.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("KVPORT_HYPOTHESIS", "deterministic"))


@pytest.fixture(autouse=True)
def _llm_leaks_nothing(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that uses a shared `llm` fixture ends with the "nothing leaked" check."""
    yield
    if "llm" in request.fixturenames:
        request.getfixturevalue("llm").engine.check_no_leaks()


@pytest.fixture
def no_c_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A machine without a C compiler, and an empty kvport cache (returned): kvport.native
    builds nothing there. Tests clear their library's cache before and after."""
    monkeypatch.delenv("KVPORT_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("KVPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    return tmp_path
