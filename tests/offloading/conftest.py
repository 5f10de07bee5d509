"""Fixtures of the OffloadingConnector tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import faulty_connector
from offload_utils import make_llm, prompts, run


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """prompts()'s greedy tokens without a connector or a prefix cache."""
    return run(make_llm(enable_prefix_caching=False), prompts())[0]


@pytest.fixture()
def no_faults() -> Iterator[None]:
    """faulty_connector's FAULTS cleared before and after the test (modules that inject faults
    use it for every test)."""
    faulty_connector.FAULTS.clear()
    yield
    faulty_connector.FAULTS.clear()
