"""max_model_len: None (the default) is the model's own limit, capped by what the KV pool holds;
an explicit value above the model's limit is an error that says what to pass instead."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hf_models import make_random_hf_model

from kvport import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose max_position_embeddings (320) is below every old default."""
    return make_random_hf_model(tmp_path_factory.mktemp("short"), max_position_embeddings=320)


def test_default_is_the_models_own_limit(short_model: Path) -> None:
    llm = LLM(str(short_model), block_size=16)
    assert llm.config.max_model_len == 320
    assert llm.engine.config.max_model_len == 320  # the scheduler and worker read this one
    out = llm.generate([[5] * 300], GREEDY, use_tqdm=False)  # long prompts are accepted ...
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="prompt has 321 tokens, longer than max_model_len=320"):
        llm.generate([[5] * 321], GREEDY, use_tqdm=False)  # ... up to the model's limit
    llm.engine.check_no_leaks()


def test_explicit_value_above_the_models_limit_is_an_error(short_model: Path) -> None:
    with pytest.raises(ValueError, match=r"max_model_len=1024 exceeds the model's "
                                         r"max_position_embeddings=320; pass max_model_len <= 320"):
        LLM(str(short_model), max_model_len=1024)


def test_default_is_capped_by_the_pool_with_a_log_line(
        short_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvport.engine.core"):
        llm = LLM(str(short_model), block_size=16, num_kv_blocks=10)
    assert llm.config.max_model_len == 160  # 10 blocks x 16 tokens
    assert "max_model_len=160" in caplog.text and "allows 320" in caplog.text
    with pytest.raises(ValueError, match="longer than max_model_len=160"):
        llm.generate([[5] * 161], GREEDY, use_tqdm=False)


def test_an_explicit_value_the_pool_cannot_hold_stays_an_error(short_model: Path) -> None:
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=320"):
        LLM(str(short_model), block_size=16, num_kv_blocks=10, max_model_len=320)


def test_builtin_default_and_explicit_value() -> None:
    assert LLM("builtin:tiny-llama").config.max_model_len == 4096  # its max_position_embeddings
    assert LLM("builtin:tiny-llama", max_model_len=64).config.max_model_len == 64
