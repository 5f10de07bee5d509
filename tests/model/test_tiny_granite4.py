"""The state-space hybrid builtin `tiny-granite4`: written deterministically with transformers'
classes, read by transformers as Granite 4 (Mamba2 and attention layers), parsed by kvport with
every multiplier, and refused with a named error where kvport cannot run a Granite config."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from kvport.model.builtin import builtin_model_dir
from kvport.model.config import FULL_ATTENTION, MAMBA, ModelConfig
from kvport.model.kv_groups import kv_cache_groups
from kvport.model.state_cache import check_state_fits

# sha256 of model.safetensors as written by tiny-granite4-v1 (integer draws: the same on every
# machine). If it ever changes, bump the version.
TINY_GRANITE4_V1_WEIGHTS_SHA256 = (
    "61e9b73b09cea5c27cdc6032ec19f286bfd03bfe14be9311e5b78cc698baae37")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builtin_model_dir("tiny-granite4", cache_dir=tmp_path_factory.mktemp("cache"))


def _config(model_dir: Path, **changes: object) -> ModelConfig:
    return ModelConfig.from_hf({**json.loads((model_dir / "config.json").read_text()), **changes})


def test_materializes_identically_in_two_caches(tmp_path: Path) -> None:
    a = builtin_model_dir("tiny-granite4", cache_dir=tmp_path / "a")
    b = builtin_model_dir("tiny-granite4", cache_dir=tmp_path / "b")
    assert a == tmp_path / "a" / "models" / "tiny-granite4-v1"
    for name in sorted(p.name for p in a.iterdir()):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    digest = hashlib.sha256((a / "model.safetensors").read_bytes()).hexdigest()
    assert digest == TINY_GRANITE4_V1_WEIGHTS_SHA256


def test_transformers_runs_it_as_a_mamba_hybrid(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == "GraniteMoeHybridForCausalLM"
    kinds = ["mamba" if layer.mamba is not None else "attention" for layer in model.model.layers]
    assert kinds == ["mamba", "attention"] * 2
    assert model.model.rotary_emb is None  # no positions in attention ("nope")


def test_kvport_reads_every_granite_field(model_dir: Path) -> None:
    config = _config(model_dir)
    assert config.architecture == "granitemoehybrid"
    assert config.layer_types == (MAMBA, FULL_ATTENTION) * 2
    assert not config.use_rope
    assert (config.embedding_multiplier, config.residual_multiplier,
            config.attention_multiplier, config.logits_scaling) == (4.0, 0.5, 0.25, 2.0)
    assert config.intermediate_size == 256  # the shared MLP's
    assert config.mamba is not None and config.mamba.state_numel == 3 * 144 + 4 * 32 * 8
    groups = kv_cache_groups(config)
    assert [(g.layer_ids, g.state, g.held_window) for g in groups] == [
        ((0, 2), True, 2), ((1, 3), False, None)]


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_local_experts": 4}, "num_local_experts=4"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type 'alibi'"),
    ({"mamba_n_groups": 3}, "mamba_n_groups=3"),
    ({"layer_types": ["mamba", "attention", "conv", "attention"]}, "'conv'"),
])
def test_configs_kvport_cannot_run_are_refused_by_name(model_dir: Path, changes: dict,
                                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(model_dir, **changes)


def test_a_block_too_small_for_the_state_names_the_smallest_that_fits(model_dir: Path) -> None:
    config = _config(model_dir)
    check_state_fits(config, 12)  # 12 x 2 x 2 x 32 = 1536 values >= 1456
    with pytest.raises(ValueError, match="block_size >= 12"):
        check_state_fits(config, 8)


def test_small_granite4_needs_blocks_of_270_tokens_in_six_groups() -> None:
    # The benchmark builtin (BENCHMARKS.md), parsed from transformers' own config of it.
    from kvport.model.builtin_hybrid import SMALL_GRANITE4_DIMS, granite4_config

    config = ModelConfig.from_hf(granite4_config(SMALL_GRANITE4_DIMS).to_dict())
    assert config.mamba is not None and config.mamba.state_numel == 68992
    check_state_fits(config, 272)
    with pytest.raises(ValueError, match="block_size >= 270"):
        check_state_fits(config, 256)
    groups = kv_cache_groups(config)
    assert [g.state for g in groups] == [True] * 5 + [False]
    assert groups[-1].layer_ids == (5, 11)
