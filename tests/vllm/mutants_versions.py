"""Mutants of kvport.vllm's version range (vllm/compat.py): each removes one guard, and the tests
named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

REFUSED = ("tests/vllm/test_vllm_versions.py::"
           "test_outside_the_range_is_refused_unless_the_variable_is_exactly_1")

MUTANTS: list[Mutant] = [
    Mutant(
        "vllm-any-version-only-when-1", "src/kvport/vllm/compat.py",
        "    if os.environ.get(ANY_VERSION_ENV) == \"1\":\n",
        "    if os.environ.get(ANY_VERSION_ENV):\n",
        (REFUSED,),
        "a release outside the range is refused unless KVPORT_VLLM_ANY_VERSION is exactly 1"),
]
