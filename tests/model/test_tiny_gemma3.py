"""The hybrid builtin `tiny-gemma3`: written deterministically with transformers' classes, read
by transformers as Gemma 3, and run by kvport's decoder to the same greedy tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from hf_models import dense_greedy, single_thread

from kvport.model.builtin import builtin_model_dir
from kvport.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from kvport.model.loader import LoadedModel, load_model

# sha256 of model.safetensors as written by tiny-gemma3-v1 (integer draws: the same on every
# machine). If it ever changes, bump the version.
TINY_GEMMA3_V1_WEIGHTS_SHA256 = (
    "409043b1f55ff3cd23e6480da1fba5a7816bba76265234097a74b1bb2a9de5cc")
WINDOW = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builtin_model_dir("tiny-gemma3", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny(model_dir: Path) -> LoadedModel:
    return load_model(str(model_dir), torch.float32)


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    # Longer than the window, so sliding layers forget the start and full layers do not.
    text = "kvport keeps and moves the KV cache of LLM inference; "
    return [loaded.tokenizer.encode(text * k + tail) for k, tail in
            ((1, "hello"), (2, "The capital of France is"), (3, "1 2 3 4 5 6"))]


def test_materializes_identically_in_two_caches(tmp_path: Path) -> None:
    a = builtin_model_dir("tiny-gemma3", cache_dir=tmp_path / "a")
    b = builtin_model_dir("tiny-gemma3", cache_dir=tmp_path / "b")
    assert a == tmp_path / "a" / "models" / "tiny-gemma3-v1"
    names = sorted(p.name for p in a.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    digest = hashlib.sha256((a / "model.safetensors").read_bytes()).hexdigest()
    assert digest == TINY_GEMMA3_V1_WEIGHTS_SHA256


def test_transformers_reads_a_gemma3_hybrid(model_dir: Path, tiny: LoadedModel) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "gemma3_text"
    assert config.sliding_window == WINDOW
    types = [SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION] * 2
    assert config.layer_types == types
    assert tiny.config.layer_types == tuple(types)
    assert tiny.config.is_hybrid
    assert [tiny.config.layer_window(i) for i in range(6)] == [WINDOW, WINDOW, None] * 2


def test_greedy_output_equals_transformers(model_dir: Path, tiny: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    theirs_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for ids in _prompts(tiny):
        assert len(ids) > WINDOW
        ours = dense_greedy(tiny.model, ids, 16)
        with torch.inference_mode(), single_thread():
            out = theirs_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        assert ours == out[0, len(ids):].tolist()


def test_continuations_depend_on_context_beyond_the_window(tiny: LoadedModel) -> None:
    # The same last 60 bytes (tokens), different starts: only the full-attention layers see the
    # difference.
    tail = "and then the same sixty characters of text end both prompts"
    assert len(tail) > WINDOW
    a = dense_greedy(tiny.model, tiny.tokenizer.encode("First story: " + tail), 12)
    b = dense_greedy(tiny.model, tiny.tokenizer.encode("Another beginning, longer: " + tail), 12)
    assert a != b
    assert len(set(a)) > 3  # not one repeated token



def test_small_gemma3_has_gemma3_270m_shape_in_six_groups() -> None:
    # The benchmark builtin (BENCHMARKS.md): parsed from transformers' own config of it, without
    # writing its 400 MB of weights.
    from kvport.model.builtin_hybrid import SMALL_GEMMA3_DIMS, gemma3_config
    from kvport.model.config import ModelConfig
    from kvport.model.kv_groups import kv_cache_groups

    config = ModelConfig.from_hf(gemma3_config(SMALL_GEMMA3_DIMS).to_dict())
    assert (config.hidden_size, config.num_hidden_layers, config.sliding_window) == (640, 18, 512)
    groups = kv_cache_groups(config)
    assert [g.sliding_window for g in groups] == [512] * 5 + [None]
    assert groups[-1].layer_ids == (5, 11, 17)
