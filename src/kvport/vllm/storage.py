"""What the vLLM adapter settles before a kvport connector starts: the KVCacheSpec it gets (vLLM's
pool geometry, tensor parallelism, vLLM's habits), and, for a connector whose stored KV other
engines read (a disk or Redis tier, the ExampleConnector's files), the namespace's model
identity (or the refusal to share without one) and vLLM's load-failure policy.

Why the policy: with shared storage, a load can fail for reasons that are not faults of this
engine (a Redis key evicted between EXISTS and GET, a run another process evicted, a corrupt
entry, Redis down at GET time). vLLM's default `kv_load_failure_policy="fail"` turns each into a
failed request; "recompute" turns it into the miss it is. vLLM 0.32 reads the policy from the
same kv_transfer_config object right after it built the scheduler-side connector
(Scheduler.__init__), so setting it there takes effect.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kvport.connectors.base import EngineInfo, KVCacheSpec
from kvport.vllm.groups import VllmGroups
from kvport.vllm.identity import identity_digest, model_identity
from kvport.vllm.objects import hash_root
from kvport.vllm.pages import page_geometry, resolved_layout

logger = logging.getLogger(__name__)
# A block's bytes: each layer's page of vLLM's pool, in layer order, each page as vLLM's
# resolved layout orders it (pages.resolved_layout: "vllm-LBHNC").
LAYOUT_PREFIX = "vllm-"


def kvport_spec(vllm_config: Any, kv_cache_config: Any, groups: VllmGroups, tp_rank: int,
                namespace: str | None, shares_storage: bool, where: str) -> KVCacheSpec:
    """The spec kvport's connector gets: vLLM's pool geometry (pages.py: every group's page,
    one geometry for all) and KV cache groups (groups.py); the layout names vLLM's resolved
    layout and this rank's shard, and the hash root names the model (identity.py) where stored
    KV is shared with other engines, as vLLM's block hashes do not."""
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    spec = specs[0]
    pages = {page_geometry(s, where) for s in specs}
    if len(pages) != 1:
        raise ValueError(f"{where}: KV cache groups with different pages {sorted(map(str, pages))}"
                         f"; kvport offloads groups of one page geometry")
    page = pages.pop()
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    layout = (f"{LAYOUT_PREFIX}{resolved_layout(vllm_config, kv_cache_config, where)}"
              f"|tp{tp_rank}of{tp_size}")
    # With several KV cache groups vLLM 0.32 takes failed loads per request only
    # (KVConnectorTransferResults.failed_recving); block ids would stop the engine.
    events = getattr(vllm_config, "kv_events_config", None)
    engine = EngineInfo(tp_size=tp_size, tp_rank=tp_rank, stops_when_idle=True,
                        caches_failed_sync_loads=True,
                        load_failures_per_request=groups.num_groups > 1,
                        kv_events=bool(events is not None and events.enable_kv_cache_events))
    kvport = KVCacheSpec(
        num_blocks=kv_cache_config.num_blocks, block_size=spec.block_size,
        num_layers=len(groups.layer_index), num_kv_heads=page.num_kv_heads,
        head_dim=page.head_dim, dtype=page.dtype, layout=layout, engine=engine,
        groups=groups.groups)
    if not shares_storage:
        return kvport
    identity = namespace_identity(vllm_config, namespace, where)
    root = hash_root(identity, page.dtype, spec.block_size, layout,
                     vllm_config.cache_config.prefix_caching_hash_algo)
    return dataclasses.replace(kvport, hash_root=root)


def namespace_identity(vllm_config: Any, namespace: str | None, where: str) -> str:
    """The model identity shared storage is namespaced by. ValueError where the weights cannot
    be identified and the config names no `namespace`: sharing by name alone could serve
    another model's KV under the same name."""
    identity = model_identity(vllm_config)
    if not identity.established and namespace is None:
        raise ValueError(
            f"{where}: its stored KV is shared with other processes, but the weights of model "
            f"{identity.model!r} cannot be identified (no full commit revision, no Hugging "
            f"Face cache snapshot, no readable weight files), so another model served under "
            f"the same name could read this one's KV; pass --revision <commit hash>, or name "
            f"the weights yourself with kv_connector_extra_config \"namespace\": "
            f"\"<model-and-version>\" (engines with equal namespaces share entries)")
    logger.info("%s: model identity %s (revision %s, weights digest %s, namespace %s)", where,
                identity_digest(identity), identity.revision, identity.weights_digest, namespace)
    return identity.key()


def recompute_failed_loads(ktc: Any, where: str) -> bool:
    """Set vLLM's kv_load_failure_policy to "recompute" where it is "fail" (vLLM's default),
    with a warning saying why (the module docstring); True if it was changed."""
    if getattr(ktc, "kv_load_failure_policy", None) != "fail":
        return False
    logger.warning(
        "%s: kv_load_failure_policy set from 'fail' to 'recompute': with shared storage, a key "
        "evicted by another process, a corrupt entry or a store that went down fails a load, "
        "and 'fail' would fail the request instead of recomputing those tokens", where)
    ktc.kv_load_failure_policy = "recompute"
    return True
