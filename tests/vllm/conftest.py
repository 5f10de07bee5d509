"""Fixtures of the vLLM tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_pool import EnginePool


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePool]:
    """Processes that run vLLM engines, shared by every module that needs whole engines."""
    pool = EnginePool(tmp_path_factory.mktemp("vllm-workers"))
    yield pool
    pool.close()
