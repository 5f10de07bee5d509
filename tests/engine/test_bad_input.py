"""Bad input is rejected with a clear error before any work starts; the engine stays usable."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvport import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM("builtin:tiny-llama", max_model_len=64, block_size=4)
    yield llm
    llm.engine.check_no_leaks()


def test_prompt_longer_than_max_model_len_is_rejected_before_any_work(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt 1: prompt has 65 tokens, longer than max_model_len=64"):
        llm.generate([[1, 2, 3], [1] * 65], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.scheduler.requests  # the good prompt was not started either
    assert llm.engine.scheduler.step_id == 0
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_empty_prompt_and_out_of_vocab_tokens(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        llm.generate([[1, 10**6]], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt 0 must be a string or a list of token ids"):
        llm.generate([3.5], use_tqdm=False)  # type: ignore[list-item]


def test_mismatched_params_list(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_pool_smaller_than_one_request_is_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match=r"cannot hold one request of max_model_len=128 tokens"):
        LLM("builtin:tiny-llama", block_size=16, num_kv_blocks=7, max_model_len=128)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size"),
    (dict(dtype="int8"), "dtype"),
    (dict(max_num_seqs=-1), "max_num_seqs"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(max_model_len=10**6), "max_position_embeddings"),
    (dict(no_such_option=1), "unknown engine argument"),
    (dict(kv_connector_call_order="vllm"), r"kv_connector_call_order must be one of .*'vllm'"),
])
def test_bad_engine_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        LLM("builtin:tiny-llama", **kwargs)


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="tiny-llama"):  # the error lists the builtins
        LLM("builtin:no-such-model")
    with pytest.raises((ValueError, FileNotFoundError), match="/no/such/dir"):
        LLM("/no/such/dir")


def test_text_prompts_round_trip_through_the_tokenizer(llm: LLM) -> None:
    out = llm.generate("héllo wörld 🙂", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "héllo wörld 🙂"
    assert out.prompt == "héllo wörld 🙂"
