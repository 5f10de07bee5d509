"""What the vLLM adapter settles before its halves start, for the tiers other processes share:
the budgets split across tensor-parallel ranks, the namespace's model identity (or the refusal
to share without one), and vLLM's load-failure policy.

Why the policy: with a disk or Redis tier, a load can fail for reasons that are not faults of
this engine (a Redis key evicted between EXISTS and GET, a run another process evicted, a
corrupt entry, Redis down at GET time). vLLM's default `kv_load_failure_policy="fail"` turns
each into a failed request; "recompute" turns it into the miss it is. vLLM 0.32 reads the
policy from the same kv_transfer_config object right after it built the scheduler-side
connector (Scheduler.__init__), so setting it there takes effect.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kvport.connectors.offloading.config import DiskTierConfig, OffloadingConfig
from kvport.vllm.identity import identity_digest, model_identity

logger = logging.getLogger(__name__)
WHERE = "kvport.vllm OffloadingConnector"


def per_rank(config: OffloadingConfig, num_workers: int) -> OffloadingConfig:
    """The config one tensor-parallel rank runs with: cpu_bytes_to_use and the disk tier's
    max_bytes are the engine's, and each rank holds its shard of every block (each rank's disk
    entries live under their own namespace directory, accounted on their own)."""
    tiers = tuple(dataclasses.replace(t, max_bytes=max(1, t.max_bytes // num_workers))
                  if isinstance(t, DiskTierConfig) else t for t in config.tiers)
    return dataclasses.replace(config, cpu_bytes_to_use=config.cpu_bytes_to_use // num_workers,
                               secondary_tiers=tiers)


def recompute_failed_loads(ktc: Any, config: OffloadingConfig) -> bool:
    """With shared tiers configured, set vLLM's kv_load_failure_policy to "recompute" where it
    is "fail" (vLLM's default), with a warning saying why; True if it was changed."""
    if not config.tiers or getattr(ktc, "kv_load_failure_policy", None) != "fail":
        return False
    names = ", ".join(type(t).__name__.removesuffix("TierConfig").lower() for t in config.tiers)
    logger.warning(
        "%s: kv_load_failure_policy set from 'fail' to 'recompute': with a shared tier (%s), a "
        "key evicted by another process, a corrupt entry or a store that went down fails a "
        "load, and 'fail' would fail the request instead of recomputing those tokens", WHERE,
        names)
    ktc.kv_load_failure_policy = "recompute"
    return True


def namespace_identity(vllm_config: Any, config: OffloadingConfig) -> str:
    """The model identity the shared tiers' namespace is hashed from. ValueError where the
    weights cannot be identified and the config names no `namespace`: sharing by name alone
    could serve another model's KV under the same name."""
    identity = model_identity(vllm_config)
    if not identity.established and config.namespace is None:
        raise ValueError(
            f"{WHERE}: secondary_tiers are shared with other processes, but the weights of "
            f"model {identity.model!r} cannot be identified (no full commit revision, no "
            f"Hugging Face cache snapshot, no readable weight files), so another model served "
            f"under the same name could read this one's KV; pass --revision <commit hash>, or "
            f"name the weights yourself with kv_connector_extra_config \"namespace\": "
            f"\"<model-and-version>\" (engines with equal namespaces share entries)")
    logger.info("%s: model identity %s (revision %s, weights digest %s, namespace %s)", WHERE,
                identity_digest(identity), identity.revision, identity.weights_digest,
                config.namespace)
    return identity.key()
