"""Worker rules W0-W10: the order of one worker connector's calls within each step.

Checked per step (async scheduling may interleave steps in the file), in file order within one
connector group. W3, W4, W5, W8 and W10 read the group's profile (profiles.py); the others hold
under every call order. Methods without a rule (vLLM's has_connector_metadata, get_kv_connector_stats,
...) are skipped, wherever they are.
"""

from __future__ import annotations

from collections import defaultdict

from kvport.trace.events import STEP_MARKER, TraceEvent
from kvport.trace.findings import Findings
from kvport.trace.profiles import Profile

# The worker hooks whose order within one step the contract fixes.
WORKER_STEP_METHODS = frozenset({
    "handle_preemptions", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
    "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    "build_connector_worker_meta", "clear_connector_metadata", "finish_forward",
})
LAYER_HOOKS = ("wait_for_layer_load", "save_kv_layer")

_Item = tuple[int, TraceEvent]  # (trace position, record)


def check_worker(group: list[_Item], out: Findings, profile: Profile) -> None:
    steps: dict[int, list[_Item]] = defaultdict(list)
    stepless = [(pos, e) for pos, e in group if e.step is None and e.method in WORKER_STEP_METHODS]
    if stepless:
        pos, e = stepless[0]
        out.add(pos, "W0", None, None, f"{len(stepless)} per-step call(s) recorded before any "
                f"trace_step, first {e.method} (does the engine call trace_step?)")
    for pos, e in group:
        if e.step is not None and (e.method in WORKER_STEP_METHODS or e.method == STEP_MARKER):
            steps[e.step].append((pos, e))
    for step, items in steps.items():
        _StepCheck(step, items, out, profile).run()


def sync_flag(event: TraceEvent) -> bool | None:
    """start_load_kv's `ints`: [1] the step has sync loads, [0] it has none, absent: unknown."""
    return bool(event.ints[0]) if event.ints else None


class _StepCheck:
    def __init__(self, step: int, items: list[_Item], out: Findings, profile: Profile) -> None:
        self.step, self.out, self.profile = step, out, profile
        self.calls = [(pos, e) for pos, e in items if e.method != STEP_MARKER]
        self.names = [e.method for _, e in self.calls]
        self.end = self.calls[-1][0] if self.calls else items[0][0]

    def at(self, i: int) -> int:
        """Trace position of the i-th call; the step's last call for a missing one."""
        return self.calls[i][0] if 0 <= i < len(self.calls) else self.end

    def add(self, i: int, rule: str, text: str) -> None:
        self.out.add(self.at(i), rule, self.step, None, text)

    def once(self, method: str, rule: str) -> int | None:
        """Index of the single call of `method`; a violation (and the first index) otherwise."""
        idx = [i for i, name in enumerate(self.names) if name == method]
        if len(idx) != 1:
            got = "no" if not idx else f"{len(idx)} calls of"
            self.add(idx[1] if idx else -1, rule, f"{got} {method} in the step")
        return idx[0] if idx else None

    def after(self, i: int | None, j: int | None, rule: str, text: str) -> None:
        """Call i must come after call j (reported at i)."""
        if i is not None and j is not None and i <= j:
            self.add(i, rule, text)

    def hook(self, i: int) -> str:
        return f"{self.names[i]}({self.calls[i][1].layer})"

    def hooks(self, idx: list[int], where: str, rule: str = "W4") -> None:
        """One violation per step for layer hooks on the wrong side of a call (a forward has one
        or two per layer: per-hook reports would bury the one fact, that the step is out of
        order)."""
        if idx:
            more = f" and {len(idx) - 1} more layer hook(s)" if len(idx) > 1 else ""
            self.add(idx[0], rule, f"{self.hook(idx[0])}{more} {where}")

    def run(self) -> None:
        names = self.names
        hp = self.once("handle_preemptions", "W1")
        if hp is not None and hp != 0:
            self.add(0, "W1", f"{names[0]} before handle_preemptions")
        bind = self.once("bind_connector_metadata", "W2")
        if hp is not None and bind is not None and bind != hp + 1:
            self.add(bind, "W2", "bind_connector_metadata is not right after handle_preemptions "
                     f"(after {names[bind - 1] if bind else 'nothing'})")
        load = self.once("start_load_kv", "W3")
        self.after(load, bind, "W3", "start_load_kv before bind_connector_metadata")
        finished = self.once("get_finished", "W6")
        self.after(finished, load, "W6", "get_finished before start_load_kv")
        errors = self.once("get_block_ids_with_load_errors", "W7")
        self.after(errors, finished, "W7", "get_block_ids_with_load_errors before get_finished")
        meta = self.once("build_connector_worker_meta", "W8")
        self.after(meta, finished, "W8", "build_connector_worker_meta before get_finished")
        if self.profile.meta_after_load_errors:
            self.after(meta, errors, "W8",
                       "build_connector_worker_meta before get_block_ids_with_load_errors")
        clear = self.once("clear_connector_metadata", "W9")
        if clear is not None and clear != len(names) - 1:
            self.add(len(names) - 1, "W9", f"{names[-1]} after clear_connector_metadata")
        hooks = [i for i, name in enumerate(names) if name in LAYER_HOOKS]
        saves = [i for i, name in enumerate(names) if name == "wait_for_save"]
        # A drafter (vllm-mrv2): the step's results are collected, then the draft model's forward
        # runs (its layer hooks), then wait_for_save: in such a step, hooks after get_finished
        # are the drafter's, and the target model's rules do not apply to them.
        deferred = (self.profile.finalize_after_drafter and finished is not None
                    and bool(saves) and saves[0] > finished)
        draft = [i for i in hooks if deferred and finished is not None and i > finished]
        target = [i for i in hooks if i not in draft]
        self.layer_hooks(target, load, finished)
        if meta is not None:
            self.hooks([i for i in draft if i < meta], "before build_connector_worker_meta (a "
                       "drafter's forward runs after it)")
        self.pair_layer_hooks(hooks)
        self.wait_for_save(saves, hooks, load, finished, meta if deferred else None)
        self.finish_forward(bind, target, load, finished, saves)

    def layer_hooks(self, layers: list[int], load: int | None, finished: int | None) -> None:
        if finished is not None:
            self.hooks([i for i in layers if i > finished], "after get_finished")
        if load is not None:
            before = [i for i in layers if i < load]
            behind = [i for i in layers if i > load]
            flag = sync_flag(self.calls[load][1]) if self.profile.load_follows_sync_flag else True
            if flag is True:
                why = " in a step with sync loads (start_load_kv ints [1])" \
                    if self.profile.load_follows_sync_flag else ""
                self.hooks(before, f"before start_load_kv{why}")
            elif flag is False:
                self.hooks(behind, "after start_load_kv in a step without sync loads "
                           "(start_load_kv ints [0]): its loads start after the forward")
            elif before and behind:
                self.add(load, "W4", f"start_load_kv between layer hooks ({len(before)} before, "
                         f"{len(behind)} after; it has no sync flag in ints)")

    def pair_layer_hooks(self, layers: list[int]) -> None:
        loaded: set[str | None] = set()
        for i in layers:
            layer = self.calls[i][1].layer
            if self.names[i] == "wait_for_layer_load":
                loaded.add(layer)
            elif layer not in loaded:
                self.add(i, "W4", f"save_kv_layer({layer}) without an earlier "
                         f"wait_for_layer_load({layer})")

    def wait_for_save(self, saves: list[int], layers: list[int], load: int | None,
                      finished: int | None, deferred_past: int | None) -> None:
        """`deferred_past`: build_connector_worker_meta's index in a step whose wait_for_save the
        profile lets wait for a drafter (after get_finished); None otherwise."""
        if not saves:
            if self.profile.save_every_step:
                what = "a forward" if layers else "a no-forward"
                self.add(-1, "W5", f"no wait_for_save in the step ({what} step; "
                         f"{self.profile.name} calls it on every step)")
            return
        if len(saves) > 1:
            self.add(saves[1], "W5", f"{len(saves)} calls of wait_for_save")
        self.after(saves[0], load, "W5", "wait_for_save before start_load_kv")
        if layers and saves[0] < layers[-1]:
            self.add(saves[0], "W5", f"wait_for_save before {self.hook(layers[-1])}")
        # NOTE: the legacy order leaves wait_for_save and get_finished unordered on purpose.
        if deferred_past is not None:
            self.after(saves[0], deferred_past, "W5", "wait_for_save after get_finished but "
                       "before build_connector_worker_meta (a drafter's step defers it past both)")
        elif self.profile.save_every_step and finished is not None and saves[0] > finished:
            self.add(saves[0], "W5", "wait_for_save after get_finished")

    def finish_forward(self, bind: int | None, layers: list[int], load: int | None,
                       finished: int | None, saves: list[int]) -> None:
        calls = [i for i, name in enumerate(self.names) if name == "finish_forward"]
        if not calls:
            return  # optional even where the order has it: see W10's why (vllm-mrv2)
        if not self.profile.finish_forward:
            self.add(calls[0], "W10", f"finish_forward in a {self.profile.name} step: that order "
                     "has no such hook (Model Runner V2's has: --profile vllm-mrv2)")
            return
        if len(calls) > 1:
            self.add(calls[1], "W10", f"{len(calls)} calls of finish_forward")
        ff = calls[0]
        self.after(ff, bind, "W10", "finish_forward before bind_connector_metadata")
        self.hooks([i for i in layers if i > ff], "after finish_forward (the forward had ended)",
                   "W10")
        self.after(finished, ff, "W10", "get_finished before finish_forward")
        if saves:
            self.after(saves[0], ff, "W10", "wait_for_save before finish_forward")
        if load is not None:
            flag = sync_flag(self.calls[load][1])
            if flag is False and load < ff:
                self.add(ff, "W10", "finish_forward after start_load_kv in a step without sync "
                         "loads (ints [0]): its loads start after the forward has ended")
            elif flag is True and load > ff:
                self.add(load, "W10", "start_load_kv after finish_forward in a step with sync "
                         "loads (ints [1]): the forward reads them")
