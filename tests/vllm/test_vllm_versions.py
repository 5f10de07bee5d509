"""kvport.vllm's version range (compat.py) and KVPORT_VLLM_ANY_VERSION, which turns the refusal of
a release outside it into one logged warning (tools/vllm_matrix.py sets it to try a release).
Strings only: no vLLM import, milliseconds."""

from __future__ import annotations

import logging

import pytest

from kvport.vllm import compat
from kvport.vllm.compat import ANY_VERSION_ENV, check_version


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ANY_VERSION_ENV, raising=False)
    monkeypatch.setattr(compat, "_warned", set())


@pytest.mark.parametrize("value", [None, "0", "true", "yes", ""])
def test_outside_the_range_is_refused_unless_the_variable_is_exactly_1(
        monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is not None:
        monkeypatch.setenv(ANY_VERSION_ENV, value)
    with pytest.raises(ImportError, match=rf"found 0\.29\.0; install a supported one: pip "
                                          rf".*{ANY_VERSION_ENV}=1"):
        check_version("0.29.0")


def test_with_the_variable_set_to_1_a_release_outside_is_warned_of_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ANY_VERSION_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="kvport.vllm.compat"):
        check_version("0.29.0")
        check_version("0.29.0")
        check_version("9.0.0")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "found 0.29.0; going on because KVPORT_VLLM_ANY_VERSION=1" in messages[0]
    assert "found 9.0.0" in messages[1]


def test_inside_the_range_nothing_is_said(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    lo = ".".join(map(str, compat.MIN_VERSION))
    with caplog.at_level(logging.WARNING, logger="kvport.vllm.compat"):
        check_version(lo)
        monkeypatch.setenv(ANY_VERSION_ENV, "1")
        check_version(lo)
    assert caplog.records == []
