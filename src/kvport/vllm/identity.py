"""The identity of the model a vLLM engine serves, as kvport's shared tiers (disk, Redis) are
namespaced by it. vLLM's block hashes depend on the tokens only: two engines whose weights
differ under one name would otherwise serve each other's KV.

The identity is made of
- the weights: the resolved revision (a full commit hash given as `revision`, the commit
  transformers recorded when it loaded the config (`_commit_hash`), or the name of the Hugging
  Face cache snapshot directory the weights are read from) and a content digest of the weights'
  directory (kvport.model.checkpoint_digest; a local directory or the cache snapshot);
- how they are turned into a model: dtype, quantization, load format, model implementation,
  code revision, KV cache dtype, hf_overrides and the loaded config (after the overrides: rope
  scaling, layer counts, quantization_config).

It is *established* when the weights are pinned: a resolved revision or a digest of a directory
holding weight files. Otherwise (a hub id missing from the local cache, a directory without
weights, dummy weights) only the name is known, and the shared tiers refuse to start unless the
configuration names an explicit `namespace` (connector.py).

Duck-typed over vLLM's ModelConfig, LoadConfig and CacheConfig: nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvport.model.checkpoint_digest import checkpoint_digest

logger = logging.getLogger(__name__)
FULL_HASH = re.compile(r"[0-9a-f]{40}")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".msgpack", ".h5",
                   ".npz")
# Parts of the loaded config that name where it was read from, not what it is.
CONFIG_LOCATION_KEYS = ("_name_or_path", "name_or_path", "_commit_hash", "transformers_version")


@dataclass(frozen=True)
class ModelIdentity:
    model: str  # the name vLLM was given (a hub id or a path)
    revision: str | None  # a full commit hash, or None where none could be resolved
    weights_digest: str | None  # checkpoint_digest of the weights' directory, or None
    settings: str  # canonical JSON: dtype, quantization, ..., the loaded config

    @property
    def established(self) -> bool:
        """Whether the weights are pinned (a commit or a content digest), not only named."""
        return self.revision is not None or self.weights_digest is not None

    def key(self) -> str:
        """The text the namespace is hashed from. A local directory is named by its content,
        not its path: a copy elsewhere shares the KV, other weights under one path do not."""
        name = "" if self.weights_digest is not None and Path(self.model).exists() else self.model
        return "|".join(["vllm-model-v2", name, self.revision or "-", self.weights_digest or "-",
                         self.settings])


def model_identity(vllm_config: Any) -> ModelIdentity:
    """The identity of vllm_config's model (see the module docstring). Reads no network: a hub
    id is looked up in the local Hugging Face cache only."""
    mc = vllm_config.model_config
    model = str(mc.model)
    given = getattr(mc, "revision", None)
    hf_config = getattr(mc, "hf_config", None)
    revision = resolve_revision(model, given, hf_config)
    weights = weights_location(model, given if revision is None else revision)
    if revision is None and weights is not None and FULL_HASH.fullmatch(weights.name) and \
            weights.parent.name == "snapshots":
        revision = weights.name  # a Hugging Face cache snapshot is named by its commit
    digest = _digest(weights, getattr(vllm_config.load_config, "load_format", "auto"))
    return ModelIdentity(model, revision, digest, settings(vllm_config))


def resolve_revision(model: str, revision: str | None, hf_config: Any) -> str | None:
    """A full commit hash for the model: `revision` if it is one, else the one transformers
    recorded loading the config from the hub, else None (a branch or tag name moves)."""
    if revision and FULL_HASH.fullmatch(revision):
        return revision
    recorded = getattr(hf_config, "_commit_hash", None)
    if isinstance(recorded, str) and FULL_HASH.fullmatch(recorded):
        return recorded
    return None


def weights_location(model: str, revision: str | None) -> Path | None:
    """Where the weights are read from: the local directory or file, else the Hugging Face
    cache snapshot of the hub id at `revision` (default: main), or None."""
    path = Path(model)
    if path.exists():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", revision=revision or "main")
    except Exception as exc:  # noqa: BLE001  # a bad repo id, no hub client: no location
        logger.debug("kvport.vllm: no cache snapshot of %r: %s", model, exc)
        return None
    return Path(found).parent if isinstance(found, str) else None


def _digest(weights: Path | None, load_format: Any) -> str | None:
    """checkpoint_digest of a location that holds weight files; None where it holds none, or
    the weights are not read from it (dummy weights), or it cannot be read."""
    if weights is None or str(load_format) == "dummy":
        return None
    try:
        if weights.is_dir() and not any(p.suffix in WEIGHT_SUFFIXES for p in weights.rglob("*")
                                        if p.is_file()):
            return None
        return checkpoint_digest(weights)
    except OSError as exc:
        logger.warning("kvport.vllm: cannot read the weights at %s for the model identity: %s",
                       weights, exc)
        return None


def settings(vllm_config: Any) -> str:
    """Canonical JSON of what turns the weights into the served model's KV."""
    mc = vllm_config.model_config
    fields = {
        "dtype": mc.dtype,
        "quantization": getattr(mc, "quantization", None),
        "load_format": getattr(vllm_config.load_config, "load_format", None),
        "model_impl": getattr(mc, "model_impl", None),
        "code_revision": getattr(mc, "code_revision", None),
        "kv_cache_dtype": getattr(vllm_config.cache_config, "cache_dtype", None),
        # fp8 KV: scales computed by each engine from its first batch read the same bytes as
        # other values than the checkpoint's scales would
        "calculate_kv_scales": getattr(vllm_config.cache_config, "calculate_kv_scales", None),
        "hf_overrides": getattr(mc, "hf_overrides", None),
        "config": loaded_config(getattr(mc, "hf_config", None)),
    }
    return json.dumps(fields, sort_keys=True, default=_canonical)


def loaded_config(hf_config: Any) -> Any:
    """The loaded (overridden) model config as a dict, without the keys naming its location."""
    if hf_config is None:
        return None
    to_dict = getattr(hf_config, "to_dict", None)
    out = dict(to_dict()) if callable(to_dict) else dict(vars(hf_config))
    for key in CONFIG_LOCATION_KEYS:
        out.pop(key, None)
    return out


def _canonical(value: Any) -> str:
    """JSON for what json cannot write: a callable by its qualified name (a repr would carry
    its address, which differs in every process), anything else by str."""
    if callable(value):
        return f"callable:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return str(value)


def identity_digest(identity: ModelIdentity) -> str:
    """A short hex digest of the identity, for logs (the key itself may be long)."""
    return hashlib.sha256(identity.key().encode()).hexdigest()[:16]
