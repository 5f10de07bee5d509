"""Tokenizer of a Hugging Face model directory, without transformers.

Reads `tokenizer.json` with the `tokenizers` library and `tokenizer_config.json` for the special
tokens, BOS/EOS insertion and the chat template (or `chat_template.jinja`, which newer transformers
writes next to it and which wins, as in transformers).

Which special tokens `encode` adds follows transformers' fast tokenizers: the post-processor stored
in `tokenizer.json` decides (no post-processor: nothing is added), and the `add_bos_token` /
`add_eos_token` flags of `tokenizer_config.json` are ignored, except by the Llama tokenizer
classes, which rebuild the post-processor from those flags when the config sets them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


# tokenizer_class values whose transformers class rebuilds BOS/EOS insertion from the config flags
_FLAG_DRIVEN_CLASSES = (
    "LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


class Tokenizer:
    def __init__(
        self, backend: BackendTokenizer, config: dict[str, Any], chat_template: str | None
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template
        # name -> token string, for the chat template (`bos_token`, `eos_token`, ...)
        self.special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = _token_str(config.get(key))
            if token is not None:
                self.special_tokens[key] = token
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")
        explicit = "add_bos_token" in config or "add_eos_token" in config
        if explicit and config.get("tokenizer_class") in _FLAG_DRIVEN_CLASSES:
            self._set_post_processor(
                bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir}")
        backend = BackendTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        return cls(backend, config, template)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added (special) tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS/EOS added as the model's HF tokenizer adds them by default.

        Pass `add_special_tokens=False` for text that already carries them (a rendered chat).
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation with the model's chat template (jinja2, sandboxed)."""
        if self.chat_template is None:
            raise ValueError(
                "this model's tokenizer has no chat_template; pass plain prompts instead")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            tools=None, documents=None, **self.special_tokens,
        )

    def _id_of(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos = add_bos and bos is not None and self.bos_token_id is not None
        add_eos = add_eos and eos is not None and self.eos_token_id is not None
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
        specials = [(bos, self.bos_token_id)] * add_bos + [(eos, self.eos_token_id)] * add_eos
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials)
