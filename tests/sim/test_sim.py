"""The seeded deterministic simulation (simulation.py) in CI: a small seed budget, and the
same seed giving the same run. Long runs: `python tests/sim/simulation.py --seeds 500`.

Each seed drives kvport's engine with the OffloadingConnector (host and disk tiers) on
controlled transfers through arrivals, aborts, preemptions, held, stuck and failed transfers,
disk faults and restarts that keep the disk, and checks the oracles every step (simulation.py's
docstring). A failing seed names itself and the command that replays it.
"""

from __future__ import annotations

import pytest

from simulation import Plan, SimFailure, run_seed

CI_SEEDS = range(16)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_ci_seed(seed: int) -> None:
    try:
        result = run_seed(seed)
    except SimFailure as exc:
        pytest.fail(str(exc), pytrace=False)
    assert result.finished + result.aborted == len(Plan.from_seed(seed).arrivals)


def test_the_same_seed_gives_the_same_run() -> None:
    assert Plan.from_seed(3) == Plan.from_seed(3)
    assert Plan.from_seed(3) != Plan.from_seed(4)
    first, second = run_seed(3), run_seed(3)
    assert first == second  # tokens, the step each request ended, faults injected, counters
    assert dict(first.injected), "seed 3 should inject faults"


def test_a_broken_oracle_names_the_seed_and_its_replay() -> None:
    exc = SimFailure(7, 12, "request r3 gave [1], not [2]")
    assert "sim seed 7 failed at step 12" in str(exc)
    assert "tests/sim/simulation.py --seed 7" in str(exc)


@pytest.mark.parametrize("seed", [16, 22, 29, 85, 91, 94, 114, 145])
def test_faults_of_synchronous_loads_store_no_kv_computed_on_them(seed: int) -> None:
    """The seeds that found it: a step whose synchronous load failed (or was late) stored the
    blocks its forward computed on the missing KV, and a later hit loaded them (seed 22: wrong
    tokens). The worker now drops that request's stores of that step."""
    run_seed(seed, sync_load_faults=True)


@pytest.mark.parametrize("seed", [40, 43])
def test_seeds_that_preempt_a_request_with_stores_in_flight(seed: int) -> None:
    """Seeds whose schedule preempts a request while its stores still read its blocks, which
    the next step hands out again: the flush in handle_preemptions is what keeps them whole."""
    run_seed(seed)


@pytest.mark.parametrize("seed", [29])
def test_seeds_with_failed_copies_into_the_engine(seed: int) -> None:
    """A seed whose HOST->ENGINE copies fail part of a load: those blocks are recomputed."""
    run_seed(seed)
