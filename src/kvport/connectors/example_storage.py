"""ExampleConnector's entries on disk: one directory per stored prompt prefix.

    <root>/<key>/layers.<i>.safetensors  tensor "kv_cache": (num_tokens, 2, num_kv_heads, head_dim)
                                         (with KV cache groups a sliding-window layer holds only
                                         its window's last tokens: example_layout)
    <root>/<key>/manifest.json           format, num_tokens, num_layers, kv_heads, head_dim, dtype

An entry is written into a hidden `<root>/.tmp-*` directory and renamed into place once complete,
so a crashed save never looks like an entry. An entry that lost a file, or whose manifest does not
match what the reader expects, is a miss. Files are byte-identical for identical KV (no times,
no paths inside), so two stores of the same prompt produce identical trees.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvport.connectors.base import layer_name

FORMAT = "kvport-example-v1"
MANIFEST = "manifest.json"
TENSOR_NAME = "kv_cache"


def layer_path(entry_dir: str, layer_idx: int) -> str:
    return os.path.join(entry_dir, f"{layer_name(layer_idx)}.safetensors")


def read_manifest(root: str, key: str) -> dict[str, Any] | None:
    """The entry's manifest if the entry is complete (every layer file present), else None."""
    entry = os.path.join(root, key)
    try:
        with open(os.path.join(entry, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        num_layers = int(manifest["num_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    complete = all(os.path.isfile(layer_path(entry, i)) for i in range(num_layers))
    return manifest if manifest.get("format") == FORMAT and complete else None


def read_entry(root: str, key: str, layer_tokens: Sequence[int],
               kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """Every layer of the entry, layer i holding its last `layer_tokens[i]` tokens (all of them
    without KV cache groups: kvport.connectors.example_layout), checked against the pool's heads,
    head size and dtype. Raises (FileNotFoundError, ValueError, safetensors errors) if the entry
    is incomplete or of another shape or dtype; reads everything before returning anything."""
    num_layers = len(layer_tokens)
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    manifest = read_manifest(root, key)
    if manifest is None or manifest["num_layers"] != num_layers:
        raise FileNotFoundError(f"entry {os.path.join(root, key)} is incomplete or not for "
                                f"{num_layers} layers (manifest {manifest})")
    layers = []
    for i in range(num_layers):
        path = layer_path(os.path.join(root, key), i)
        data = load_file(path)[TENSOR_NAME]
        expected = (layer_tokens[i], 2, num_kv_heads, head_dim)
        if tuple(data.shape) != expected or data.dtype != kv_cache.dtype:
            raise ValueError(f"{path} holds {tuple(data.shape)} {data.dtype}, expected "
                             f"{expected} {kv_cache.dtype}")
        layers.append(data)
    return layers


def new_tmp_dir(root: str, key: str) -> str:
    return os.path.join(root, f".tmp-{key[:16]}-{uuid.uuid4().hex}")


def write_layer(tmp_dir: str, name: str, data: torch.Tensor) -> None:
    """Write layer `name` (a `layer_name(i)`) of an entry being built in `tmp_dir`."""
    os.makedirs(tmp_dir, exist_ok=True)
    save_file({TENSOR_NAME: data.contiguous()}, os.path.join(tmp_dir, f"{name}.safetensors"))


def publish(root: str, key: str, tmp_dir: str, num_tokens: int, num_layers: int,
            kv_cache: torch.Tensor) -> None:
    """Write the manifest into `tmp_dir` (holding every layer) and rename it to `<root>/<key>`.
    `num_layers`: the model's (a pool block holds fewer with KV cache groups)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    manifest = {"format": FORMAT, "num_tokens": num_tokens, "num_layers": num_layers,
                "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                "dtype": str(kv_cache.dtype).removeprefix("torch.")}
    with open(os.path.join(tmp_dir, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, sort_keys=True)
    final = os.path.join(root, key)
    try:
        os.rename(tmp_dir, final)
    except OSError:
        if read_manifest(root, key) is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # another writer published it first
            return
        trash = f"{tmp_dir}.old"  # a damaged entry (a file was deleted) is in the way
        os.rename(final, trash)
        os.rename(tmp_dir, final)
        shutil.rmtree(trash, ignore_errors=True)


def gather(kv_layer: torch.Tensor, block_ids: tuple[int, ...]) -> torch.Tensor:
    """kv_layer (num_blocks, 2, block_size, kv_heads, head_dim) -> (n * block_size, 2, ...)."""
    blocks = kv_layer[torch.tensor(block_ids, dtype=torch.long)]  # (n, 2, bs, kv_heads, head_dim)
    return blocks.transpose(1, 2).reshape(-1, *blocks.shape[1:2], *blocks.shape[3:])


def scatter(kv_layer: torch.Tensor, block_ids: tuple[int, ...], data: torch.Tensor) -> None:
    """The inverse of gather: data (len(block_ids) * block_size, 2, kv_heads, head_dim)."""
    blocks = data.reshape(len(block_ids), kv_layer.shape[2], *data.shape[1:]).transpose(1, 2)
    kv_layer[torch.tensor(block_ids, dtype=torch.long)] = blocks
