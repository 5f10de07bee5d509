from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvport.model.byte_tokenizer import write_byte_tokenizer
from kvport.model.tokenizer import Tokenizer

TEXTS = [
    "", "Hello world", " leading and trailing  ", "tabs\tand\nnewlines\r\n", "12345 + 678 = 99.5",
    "héllo wörld ✓ 日本語 🤖🚀 👩‍👩‍👧", "<s> literal special </s> tokens",
    "\x00\x01 control bytes \x7f",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Again ✓"},
]


def _byte_dir(tmp_path: Path, add_bos: bool = True, **config_updates: Any) -> Path:
    write_byte_tokenizer(tmp_path, 320, add_bos=add_bos)
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in config_updates.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return tmp_path


def _hf(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("settings_", [
    {"add_bos": True},  # Llama style: BOS via tokenizer.json and tokenizer_config agree
    {"add_bos": False},  # Qwen style: nothing added
    {"add_bos": True, "add_bos_token": None, "add_eos_token": None},  # tokenizer.json decides
    # Generic (non-Llama) tokenizer classes ignore the config's flags: tokenizer.json decides.
    {"add_bos": True, "add_bos_token": False, "add_eos_token": None},
    {"add_bos": False, "add_bos_token": True, "add_eos_token": True},
])
def test_ids_match_transformers(tmp_path: Path, settings_: dict[str, Any]) -> None:
    add_bos = settings_.pop("add_bos")
    model_dir = _byte_dir(tmp_path, add_bos=add_bos, **settings_)
    ours, theirs = Tokenizer.from_dir(model_dir), _hf(model_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.vocab_size == len(theirs) == 320


def test_llama_tokenizer_classes_follow_the_config_flags(tmp_path: Path) -> None:
    model_dir = _byte_dir(tmp_path, add_bos=True, tokenizer_class="LlamaTokenizerFast",
                          add_bos_token=False, add_eos_token=True)
    assert Tokenizer.from_dir(model_dir).encode("ab") == [97, 98, 257]


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = _TOKENIZER
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256
    # Special-token strings inside text become special tokens (as in every HF tokenizer), so the
    # exact round trip keeps them; plain text has one token per UTF-8 byte.
    assert tok.decode(ids[1:], skip_special_tokens=False) == text
    if "<" not in text:
        assert ids[1:] == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_chat_template_matches_transformers(tmp_path: Path) -> None:
    model_dir = _byte_dir(tmp_path)
    ours, theirs = Tokenizer.from_dir(model_dir), _hf(model_dir)
    for add in (True, False):
        expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add) == expected
    assert ours.apply_chat_template(MESSAGES[:2]).endswith("<|im_start|>assistant\n")


def test_chat_template_file_wins_and_sees_special_tokens(tmp_path: Path) -> None:
    model_dir = _byte_dir(tmp_path)
    (model_dir / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    ours = Tokenizer.from_dir(model_dir)
    rendered = ours.apply_chat_template([{"role": "user", "content": " x "}])
    assert rendered == "<s>[user] x\n[assistant]"
    assert rendered == _hf(model_dir).apply_chat_template(
        [{"role": "user", "content": " x "}], tokenize=False, add_generation_prompt=True)


def test_chat_template_errors(tmp_path: Path) -> None:
    model_dir = _byte_dir(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_dir(model_dir).apply_chat_template(MESSAGES)
    (model_dir / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        Tokenizer.from_dir(model_dir).apply_chat_template(MESSAGES)


def test_missing_tokenizer_json_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"tokenizer.json.*{tmp_path}"):
        Tokenizer.from_dir(tmp_path)


def _make_module_tokenizer() -> Tokenizer:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_byte_tokenizer(Path(d), 320)
        return Tokenizer.from_dir(d)


_TOKENIZER = _make_module_tokenizer()
