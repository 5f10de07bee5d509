"""Load a model (builtin name or Hugging Face-format directory) with its config and tokenizer.

Offline only: a directory is read as it is, nothing is downloaded. Weights stream from the
safetensors files (`safe_open`, one tensor at a time) straight into the model's parameters, with the
dtype conversion done by that single copy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from kvport.model.builtin import builtin_model_dir
from kvport.model.config import ModelConfig
from kvport.model.llama import LlamaForCausalLM
from kvport.model.tokenizer import Tokenizer

BUILTIN_PREFIX = "builtin:"
SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HASH_CHUNK = 1 << 24  # bytes read at a time when hashing weight files


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM | None  # None when loaded without weights (a process that only schedules)
    tokenizer: Tokenizer
    model_dir: Path
    identity: str  # hex digest of config + weights; changes when the weights change


def load_model(model: str, dtype: torch.dtype | str, load_weights: bool = True,
               device: torch.device | str = "cpu") -> LoadedModel:
    """`model` is `builtin:NAME` or a directory with config.json, *.safetensors, tokenizer.json.

    `load_weights=False` reads everything but the weights (for a process that only schedules).
    `device`: where the weights go (the caller checked that it exists: kvport.engine.device)."""
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
    files = safetensors_files(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    net = None
    if load_weights:
        net = model_class(config)(config, dtype)
        net.load_weights(iter_weights(files))
        if device.type == "cpu":
            net.pack_weights()
        else:
            # The packed layouts are the CPU's (oneDNN, the tiled C kernel): elsewhere the model
            # keeps torch's nn.Linear and moves as it is, one copy of each weight.
            net.to(device)
    return LoadedModel(config, net, tokenizer, model_dir, model_identity(model_dir, files))


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The model code that runs `config`'s architecture."""
    if config.architecture == "gemma3_text":
        from kvport.model.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if config.architecture == "granitemoehybrid":
        from kvport.model.granite4 import Granite4ForCausalLM

        return Granite4ForCausalLM
    return LlamaForCausalLM


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(SUPPORTED_DTYPES)}")
        return SUPPORTED_DTYPES[dtype]
    if dtype not in SUPPORTED_DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}; supported: {sorted(SUPPORTED_DTYPES)}")
    return dtype


def resolve_model_dir(model: str | Path) -> Path:
    """`builtin:NAME` -> its cache directory (materialized if needed); else an existing dir."""
    if isinstance(model, str) and model.startswith(BUILTIN_PREFIX):
        return builtin_model_dir(model.removeprefix(BUILTIN_PREFIX))
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist (nor is {model!r} a "
                                f"'{BUILTIN_PREFIX}NAME' builtin)")
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory")
    return path


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else None
    return ModelConfig.from_hf(json.loads(path.read_text(encoding="utf-8")), gen)


def safetensors_files(model_dir: Path) -> list[Path]:
    """Weight files: those named by model.safetensors.index.json if present, else *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names missing shard files: {absent}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in model directory {model_dir}")
    return files


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)


def model_identity(model_dir: Path, files: list[Path] | None = None) -> str:
    """sha256 over config.json and, per weight file, its name, size and a hash of all its bytes.

    The content hash is xxh3-128 (tens of GB/s, so ~0.05 s for a 500 MB file once it is in the page
    cache, which loading fills anyway): any change of any weight changes the identity, and copying
    or moving the directory does not.
    """
    files = safetensors_files(model_dir) if files is None else files
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    for path in files:
        content = xxhash.xxh3_128()
        with open(path, "rb") as f:
            while n := f.readinto(buf):
                content.update(view[:n])
        h.update(f"\0{path.name}\0{path.stat().st_size}\0".encode())
        h.update(content.digest())
    return h.hexdigest()
