"""tests/needs.py: a missing real part fails the test that needs it, it never skips it."""

from __future__ import annotations

import pytest
from needs import missing, native_switched_off, require


def test_a_missing_module_fails_with_what_to_install() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"module 'no_such_kvport_module' is not "
                                                    r"installed: pip install it"):
        require("no_such_kvport_module", "pip install it")
    assert missing("no_such_kvport_module") and missing("no_such_parent.child")


def test_a_false_condition_fails_and_a_true_one_passes() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"not available: block_copy.c must build"):
        require(False, "block_copy.c must build")
    require(True, "never shown")
    require("json", "the standard library")


def test_only_an_explicit_zero_switches_native_code_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPORT_NATIVE_KERNELS", "0")
    assert native_switched_off()
    for value in ("1", "", "no"):
        monkeypatch.setenv("KVPORT_NATIVE_KERNELS", value)
        assert not native_switched_off()
    monkeypatch.delenv("KVPORT_NATIVE_KERNELS")
    assert not native_switched_off()
