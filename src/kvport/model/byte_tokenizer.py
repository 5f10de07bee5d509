"""The builtins' byte-level tokenizer: one token per byte, so any text round-trips, plus three
specials and reserved ids up to the model's vocabulary size."""

from __future__ import annotations

import json
from pathlib import Path

BYTE_BOS, BYTE_EOS, BYTE_PAD = "<s>", "</s>", "<pad>"


def byte_to_unicode() -> dict[int, str]:
    """Byte -> printable character, the byte-level BPE alphabet of GPT-2-style tokenizers.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to code points from
    256 up, so no token is whitespace or a control character.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def write_byte_tokenizer(out_dir: Path, vocab_size: int = 320, add_bos: bool = True,
                         model_max_length: int = 4096) -> None:
    """tokenizer.json + tokenizer_config.json: id b is byte b, then <s>, </s>, <pad>, reserved.

    All ids below `vocab_size` are named (unused ones as `<|reserved_N|>` specials), so any id a
    random model samples decodes. Special-token strings inside text are parsed as special tokens,
    as in every Hugging Face tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    if vocab_size < 259:
        raise ValueError(
            f"byte tokenizer needs vocab_size >= 259 (256 bytes + 3 specials), got {vocab_size}")
    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - 259)]
    tok.add_special_tokens([BYTE_BOS, BYTE_EOS, BYTE_PAD, *reserved])  # ids 256, 257, 258, ...
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BYTE_BOS} $A", pair=f"{BYTE_BOS} $A {BYTE_BOS} $B",
            special_tokens=[(BYTE_BOS, 256)])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BYTE_BOS, "eos_token": BYTE_EOS, "pad_token": BYTE_PAD,
        "add_bos_token": add_bos, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        # A minimal ChatML-style template, so chat code paths run on the builtin model too.
        "chat_template": (
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}{% endif %}"
        ),
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
