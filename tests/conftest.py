"""Suite-wide fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _llm_leaks_nothing(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that uses a shared `llm` fixture ends with the "nothing leaked" check."""
    yield
    if "llm" in request.fixturenames:
        request.getfixturevalue("llm").engine.check_no_leaks()
