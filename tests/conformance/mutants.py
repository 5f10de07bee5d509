"""Mutants of kvport conformance (src/kvport/conformance/): each removes one guard of the search
or of how a workload's records are read and judged; the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

DRIVER = "src/kvport/conformance/driver.py"
SEARCH = "src/kvport/conformance/search.py"
CONNECTORS = "src/kvport/conformance/connectors.py"
T_SEARCH = "tests/conformance/test_search.py"
T_WORKLOAD = "tests/conformance/test_workload.py"

MUTANTS: list[Mutant] = [
    Mutant(
        "conformance-whole-lines-only", DRIVER,
        '    end = data.rfind(b"\\n") + 1\n',
        "    end = len(data)\n",
        (f"{T_SEARCH}::test_records_are_read_whole_lines_at_a_time",),
        "a record the recorder is still writing is read with the next workload, not cut"),
    Mutant(
        "conformance-arrivals-outside-any-step", DRIVER,
        "        out.append(e if group in stepped or e.step is None else replace(e, step=None))\n",
        "        out.append(e)\n",
        (f"{T_SEARCH}::test_a_workloads_records_before_its_first_step_are_outside_any_step",),
        "records before a workload's first step are not judged as the previous workload's step"),
    Mutant(
        "conformance-crash-drops-what-it-made", DRIVER,
        "    return [v for v in violations if v.rule in _AT_THE_CALL or not made_by_the_stop(v)]\n",
        "    return list(violations)\n",
        (f"{T_SEARCH}::test_a_crash_drops_only_what_the_stop_made",),
        "calls a crash kept from coming are not reported as the connector's violations"),
    Mutant(
        "conformance-set-aside-rules", SEARCH,
        "        return next((v.rule for v in outcome.violations if v.rule not in set_aside), None)\n",
        "        return outcome.violations[0].rule\n",
        (f"{T_SEARCH}::test_a_crash_after_a_broken_rule_is_that_rules_and_alone_is_a_finding",),
        "a rule found already does not stop the search for the next one"),
    Mutant(
        "conformance-shrink-on-fresh-engines", SEARCH,
        "            outcome = self._session.run(workload, fresh=shrinking)\n",
        "            outcome = self._session.run(workload, fresh=False)\n",
        (f"{T_SEARCH}::test_a_shrunk_workload_breaks_its_rule_alone",),
        "a shrunk workload breaks its rule alone, not through an earlier workload's store"),
    Mutant(
        "conformance-shrink-budget", SEARCH,
        "            if self._shrink_plays >= self._max_shrink_plays or self._played >= "
        "self._limit:\n",
        "            if False:\n",
        (f"{T_SEARCH}::test_the_shrink_budget_bounds_the_plays_and_the_best_workload_still_fails",),
        "shrinking one finding plays at most --max-shrink workloads, each on a fresh engine"),
    Mutant(
        "conformance-found-alone-before-shrinking", SEARCH,
        "                if finding_key(alone, set_aside) is None:\n",
        "                if False:\n",
        (f"{T_SEARCH}::test_a_rule_broken_only_after_other_workloads_is_told_apart",),
        "a rule broken only after other workloads is reported as such, not shrunk to nothing"),
    Mutant(
        "conformance-json-connector-needs-a-name", CONNECTORS,
        "    if not isinstance(config, dict) or not isinstance(config.get(\"kv_connector\"), "
        "str):\n",
        "    if not isinstance(config, dict):\n",
        (f"{T_WORKLOAD}::test_a_bad_connector_is_named",),
        "a JSON connector without a kv_connector name is refused before vLLM starts"),
]
