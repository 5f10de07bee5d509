"""Mutants the simulator's seeds kill (tests/sim/): each removes one guard of the
OffloadingConnector's worker half, and the seeds named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

SIM = "tests/sim/test_sim.py"


MUTANTS: list[Mutant] = [
    # ---- the OffloadingConnector's worker half, under the simulator ----------------------------
    Mutant(
        "sim-fence-wait", "src/kvport/connectors/offloading/worker/half.py",
        "            submitter.router.wait([k for k in submitter.in_flight if k.stage is Stage.COPY\n"
        "                                   and k.job_id in meta.jobs_to_flush])\n",
        "            pass\n",
        (f"{SIM}::test_seeds_that_preempt_a_request_with_stores_in_flight[40]",
         f"{SIM}::test_seeds_that_preempt_a_request_with_stores_in_flight[43]"),
        "the simulation finds the preemption race by itself (a store reads reused blocks: torn)"),
    Mutant(
        "sim-failed-copy-reported", "src/kvport/connectors/offloading/worker/loads.py",
        "            load.engine_failed += [load.copy_dst[i] for i in result.failed_indices]\n",
        "            pass\n",
        (f"{SIM}::test_seeds_with_failed_copies_into_the_engine[29]",),
        "the simulation's failed HOST->ENGINE copies are recomputed (else wrong tokens)"),
    Mutant(
        "sim-late-load-reported", "src/kvport/connectors/offloading/worker/half.py",
        "                late.add(loads.give_up(job_id))\n",
        "                loads.give_up(job_id)\n",
        (f"{SIM}::test_ci_seed[7]", f"{SIM}::test_ci_seed[9]"),
        "a load stuck in a promotion reports its request at load_timeout_s (else it hangs)"),
]
