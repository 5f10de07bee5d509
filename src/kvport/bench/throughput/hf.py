"""transformers' `generate` as the baseline system of `kvport bench throughput`.

The baseline is transformers as a user gets it: `AutoModelForCausalLM` with its default attention
implementation and its default cache (a `DynamicCache` grown one token at a time), greedy decoding,
and `min_new_tokens == max_new_tokens` so that EOS never stops a sequence early. The prompts of one
batch have equal lengths, so no padding is involved and the attention mask is all ones.

transformers is an optional dependency (extra `kvport[bench]`) and is imported only here, lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvport.bench.throughput.config import Task
from kvport.bench.throughput.systems import PromptSets, TaskTimes, time_tasks

INSTALL_HINT = "transformers is not installed; install it with `pip install 'kvport[bench]'`"


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError(INSTALL_HINT) from exc
    return transformers


def _dtype_kwarg(version: str) -> str:
    """`dtype=` replaced `torch_dtype=` in transformers 4.56."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


class HFSystem:
    """A transformers causal LM run with `model.generate`."""

    name = "transformers"

    def __init__(self, model_dir: Path, dtype: str) -> None:
        transformers = _import_transformers()
        if not hasattr(torch, dtype):
            raise ValueError(f"unknown dtype {dtype!r}; expected e.g. 'float32' or 'bfloat16'")
        kwargs = {_dtype_kwarg(transformers.__version__): getattr(torch, dtype)}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
        self.model.eval()
        self.version: str = transformers.__version__
        self.threads = torch.get_num_threads()
        self.settings = {"attn_implementation": getattr(self.model.config, "_attn_implementation",
                                                        None),
                         "cache": "default (DynamicCache)", "dtype": dtype}
        config = self.model.config
        eos = config.eos_token_id
        # generate() wants a pad id to exist even when nothing is padded.
        self._pad_id = config.pad_token_id if config.pad_token_id is not None else (
            eos[0] if isinstance(eos, list) else eos if eos is not None else 0)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1:
            raise ValueError(f"prompts of one batch must have equal lengths, got {sorted(lengths)}")
        input_ids = torch.tensor(prompts, dtype=torch.long)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            temperature=None, top_p=None, top_k=None, pad_token_id=self._pad_id,
        )
        new: list[list[int]] = out[:, input_ids.shape[1]:].tolist()
        return new

    def run_tasks(self, prompt_sets: PromptSets, tasks: list[Task]) -> TaskTimes:
        return time_tasks(self.generate, prompt_sets, tasks)

    def close(self) -> None:
        del self.model
