"""The connector a RecordingConnector records: its kv_transfer_config and class, resolved from the
wrapper's config (recording_config.py reads it), and the class-level hooks its class answers.

vLLM calls some hooks on the class named in the config, before any connector exists
(get_required_kvcache_layout, requires_piecewise_for_cudagraph; supports_sleep_mode from 0.33;
kv_cache_access and supports_lookahead_block_hashes from 0.34): the wrapper's classmethods
resolve the inner class from the config they are given and ask it.
A config that names no loadable KVConnectorBase_V1 subclass is a ValueError that says what to
pass instead.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from kvport.vllm.compat import require_vllm
from kvport.vllm.recording_config import INHERITED, WRAPPER, RecordingSpec, parse_recording_config

require_vllm()

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Hooks vLLM calls per layer (or that are plain reads): without recording, the wrapper's
# attribute is the inner connector's bound method, so forwarding them costs no call at all.
DIRECT_WHEN_OFF = ("has_connector_metadata", "wait_for_layer_load", "save_kv_layer",
                   "start_load_kv", "wait_for_save", "get_block_ids_with_load_errors",
                   "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
                   "get_num_new_matched_tokens", "update_state_after_alloc",
                   "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids",
                   "request_finished", "update_connector_output", "take_events",
                   "has_pending_push_work", "has_pending_block_frees", "on_new_request",
                   "get_transfer_results", "get_finished", "handle_preemptions")


def _outer_fields(ktc: Any) -> dict[str, Any]:
    return {name: getattr(ktc, name) for name in INHERITED if hasattr(ktc, name)}


def recording_spec(ktc: Any) -> RecordingSpec:
    """The wrapper's spec from the outer kv_transfer_config vLLM passed."""
    if ktc is None:
        raise ValueError(f"{WRAPPER}: vLLM passed no kv_transfer_config")
    return parse_recording_config(ktc.kv_connector_extra_config, _outer_fields(ktc))


def inner_config(spec: RecordingSpec) -> KVTransferConfig:
    try:
        return KVTransferConfig(**spec.inner)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{WRAPPER}: 'connector' is not a valid kv_transfer_config "
                         f"({exc}): {spec.inner!r}") from None


def inner_class(ktc: KVTransferConfig) -> type[KVConnectorBase_V1]:
    try:
        cls = KVConnectorFactory.get_connector_class(ktc)
    except (ValueError, AttributeError, ImportError) as exc:
        where = (f"module {ktc.kv_connector_module_path!r}" if ktc.kv_connector_module_path
                 else "vLLM's connector registry")
        known = sorted(KVConnectorFactory._registry)  # for the error message only
        raise ValueError(f"{WRAPPER}: cannot load the connector to record, "
                         f"kv_connector={ktc.kv_connector!r} from {where} ({exc}); pass a "
                         f"registered name ({', '.join(known)}) or a class name with its "
                         f"kv_connector_module_path") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ValueError(  # noqa: TRY004  # a bad config value, like the others
            f"{WRAPPER}: kv_connector={ktc.kv_connector!r} is {cls!r}, not a vLLM "
            f"KVConnectorBase_V1 subclass")
    return cls


def resolve(ktc: Any) -> tuple[type[KVConnectorBase_V1], KVTransferConfig, RecordingSpec]:
    """(the inner class, the inner config, the wrapper's spec) of an outer kv_transfer_config."""
    spec = recording_spec(ktc)
    inner = inner_config(spec)
    return inner_class(inner), inner, spec


def inner_vllm_config(vllm_config: VllmConfig, inner: KVTransferConfig) -> VllmConfig:
    config = copy.copy(vllm_config)  # shallow: only kv_transfer_config differs
    config.kv_transfer_config = inner
    return config


def create_inner(vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
                 ) -> tuple[KVConnectorBase_V1, KVTransferConfig, RecordingSpec]:
    """(the recorded connector, built by vLLM's factory; its config; the wrapper's spec). The
    outer config takes the inner one's load-failure policy."""
    _, inner_ktc, spec = resolve(vllm_config.kv_transfer_config)
    inner = KVConnectorFactory.create_connector(inner_vllm_config(vllm_config, inner_ktc), role,
                                                kv_cache_config)
    outer = vllm_config.kv_transfer_config
    assert outer is not None  # resolve() refused a config without one
    if outer.kv_load_failure_policy != inner_ktc.kv_load_failure_policy:
        # The inner connector set its policy (kvport's, with shared tiers: "recompute");
        # vLLM's scheduler reads the outer config's, right after the wrapper is built.
        outer.kv_load_failure_policy = inner_ktc.kv_load_failure_policy
    return inner, inner_ktc, spec


# ---- class-level hooks, answered by the inner class ----------------------------------------------


def required_kvcache_layout(vllm_config: VllmConfig) -> str | None:
    cls, inner, _ = resolve(vllm_config.kv_transfer_config)
    return cls.get_required_kvcache_layout(inner_vllm_config(vllm_config, inner))


def requires_piecewise_for_cudagraph(extra_config: dict[str, Any]) -> bool:
    spec = parse_recording_config(extra_config)
    if "kv_role" not in spec.inner:
        # vLLM's KVTransferConfig requires a role; only the class is looked up with this one.
        spec = RecordingSpec({**spec.inner, "kv_role": "kv_both"}, spec.record_trace, spec.name)
    cls = inner_class(inner_config(spec))
    return bool(cls.requires_piecewise_for_cudagraph(
        dict(spec.inner.get("kv_connector_extra_config") or {})))


def supports_sleep_mode(kv_transfer_config: Any) -> bool:
    """vLLM >= 0.33 asks; the base class's default, True, where the inner class has no hook."""
    cls, inner, _ = resolve(kv_transfer_config)
    hook = getattr(cls, "supports_sleep_mode", None)
    return True if hook is None else bool(hook(inner))


def kv_cache_access(kv_transfer_config: Any) -> Any:
    """vLLM >= 0.34 asks how the workers reach the KV cache (a KVCacheAccess flag set, which
    decides how vLLM allocates it): vLLM's factory's answer for the inner config where the
    factory has one (0.34: the class's, with its LMCacheMPConnector exception), else the inner
    class's; IN_PROCESS (0), the base's default, where neither has the hook (vLLM < 0.34,
    which never asks)."""
    cls, inner, _ = resolve(kv_transfer_config)
    hook = getattr(KVConnectorFactory, "kv_cache_access", None)
    if hook is not None:
        return hook(inner)
    hook = getattr(cls, "kv_cache_access", None)
    return 0 if hook is None else hook(inner)


def supports_lookahead_block_hashes(kv_transfer_config: Any) -> bool:
    """vLLM >= 0.34 asks whether block hashes may cover lookahead tokens: the inner class's
    answer; the base's default, False, where the class has no hook (vLLM < 0.34)."""
    cls, inner, _ = resolve(kv_transfer_config)
    hook = getattr(cls, "supports_lookahead_block_hashes", None)
    return False if hook is None else bool(hook(inner))
