"""checkpoint_digest: what changes the digest (names, sizes, small files whole, a big file's
samples, a safetensors header and every tensor's head) and what it costs on a huge file."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvport.model.checkpoint_digest import (
    SAMPLE_BYTES, TENSOR_SAMPLE_BYTES, WHOLE_BYTES, checkpoint_digest, sample_offsets,
)

NUM_TENSORS = 48
TENSOR_ELEMS = 160_000  # float32: 640 KB each, 30 MB in all (above WHOLE_BYTES)


def _checkpoint(root: Path) -> Path:
    root.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.weight": torch.randn(TENSOR_ELEMS, generator=gen)
               for i in range(NUM_TENSORS)}
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text('{"hidden_size": 8}')
    assert (root / "model.safetensors").stat().st_size > WHOLE_BYTES
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("ckpt") / "m")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _tensor_starts(path: Path) -> list[int]:
    import json
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return sorted(8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def _sampled(path: Path, offset: int) -> bool:
    return any(o <= offset < o + SAMPLE_BYTES for o in sample_offsets(path.stat().st_size))


def test_a_copy_elsewhere_has_the_same_digest(ckpt: Path, tmp_path: Path) -> None:
    assert checkpoint_digest(ckpt) == checkpoint_digest(_copy(ckpt, tmp_path / "other"))
    assert checkpoint_digest(ckpt, mode="full") == checkpoint_digest(tmp_path / "other", "full")
    assert checkpoint_digest(ckpt) != checkpoint_digest(ckpt, mode="full")


def test_a_changed_byte_at_a_tensor_head_outside_the_fixed_samples_changes_it(
        ckpt: Path, tmp_path: Path) -> None:
    weights = ckpt / "model.safetensors"
    starts = [s for s in _tensor_starts(weights) if not _sampled(weights, s)]
    assert starts, "every tensor head lies in a fixed sample: the test proves nothing"
    changed = _copy(ckpt, tmp_path / "changed")
    _flip(changed / "model.safetensors", starts[len(starts) // 2] + TENSOR_SAMPLE_BYTES - 1)
    assert checkpoint_digest(changed) != checkpoint_digest(ckpt)


def test_a_changed_byte_in_a_fixed_sample_changes_it(ckpt: Path, tmp_path: Path) -> None:
    weights = ckpt / "model.safetensors"
    size = weights.stat().st_size
    changed = _copy(ckpt, tmp_path / "changed")
    _flip(changed / "model.safetensors", sample_offsets(size)[5] + SAMPLE_BYTES // 2)
    assert checkpoint_digest(changed) != checkpoint_digest(ckpt)


def test_a_byte_outside_every_sample_changes_only_the_full_digest(
        ckpt: Path, tmp_path: Path) -> None:
    """The documented limit of the sampled mode, and what mode="full" is for."""
    weights = ckpt / "model.safetensors"
    heads = [(s, s + TENSOR_SAMPLE_BYTES) for s in _tensor_starts(weights)]
    half = weights.stat().st_size // 2
    offset = next(o for o in range(half, 2 * half, 4099)
                  if not _sampled(weights, o) and not any(a <= o < b for a, b in heads))
    changed = _copy(ckpt, tmp_path / "changed")
    _flip(changed / "model.safetensors", offset)
    assert checkpoint_digest(changed) == checkpoint_digest(ckpt)
    assert checkpoint_digest(changed, "full") != checkpoint_digest(ckpt, "full")


def test_names_sizes_and_small_files_change_it(ckpt: Path, tmp_path: Path) -> None:
    base = checkpoint_digest(ckpt)
    renamed = _copy(ckpt, tmp_path / "renamed")
    (renamed / "model.safetensors").rename(renamed / "model-00001.safetensors")
    resized = _copy(ckpt, tmp_path / "resized")
    with open(resized / "model.safetensors", "ab") as f:
        f.write(b"\0")
    edited = _copy(ckpt, tmp_path / "edited")
    (edited / "config.json").write_text('{"hidden_size": 9}')
    added = _copy(ckpt, tmp_path / "added")
    (added / "pytorch_model.bin").write_bytes(b"x")
    digests = {checkpoint_digest(p) for p in (renamed, resized, edited, added)}
    assert len(digests) == 4 and base not in digests
    hidden = _copy(ckpt, tmp_path / "hidden")
    (hidden / ".cache").mkdir()
    (hidden / ".cache" / "download.lock").write_text("x")
    assert checkpoint_digest(hidden) == base  # download metadata is not the checkpoint


def test_a_single_weights_file_is_a_checkpoint(ckpt: Path) -> None:
    one = ckpt / "model.safetensors"
    assert checkpoint_digest(one) == checkpoint_digest(one)
    assert checkpoint_digest(one) != checkpoint_digest(ckpt)


def test_a_100_gib_sparse_file_is_digested_in_bounded_time(tmp_path: Path) -> None:
    huge = tmp_path / "huge" / "model.safetensors"
    huge.parent.mkdir()
    with open(huge, "wb") as f:
        f.truncate(100 << 30)
    if os.stat(huge).st_blocks:  # a file system without sparse files would write 100 GiB
        pytest.fail(f"{tmp_path} does not keep sparse files; the bound would measure the disk")
    start = time.perf_counter()
    checkpoint_digest(huge.parent)
    assert time.perf_counter() - start < 20.0  # measured ~0.5 s; generous for a busy CI


def test_an_unknown_mode_is_refused(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="'quick'"):
        checkpoint_digest(ckpt, mode="quick")
