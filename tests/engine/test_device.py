"""The engine's device (`EngineConfig.device`): checked at the boundary, the same output on the
CPU however it is named, and every tensor of a step made on the device.

No GPU here: the device-placement checks run on torch's "meta" device, which, like CUDA, refuses
a CPU tensor (other than a 0-d scalar) mixed into its ops and refuses to read a value back to the
host (`.item()`, `.tolist()`, `int()`), so a step that runs on it builds nothing on the wrong
device and reads nothing back. tools/gpu_check runs the engine on a real GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import kvport.engine.runner as runner_module
from kvport import LLM, EngineConfig, SamplingParams
from kvport.engine.device import resolve_device
from kvport.engine.runner import ModelRunner
from kvport.engine.step import ModelRunnerOutput
from kvport.model import kernels, sampler
from kvport.model.attention import PagedAttention, window_mask
from kvport.model.loader import load_model
from kvport.model.state_cache import PagedStateAttention

META = torch.device("meta")
PROMPTS = [list(range(1, 41)), list(range(1, 33)) + [7, 8, 9], [5, 6, 7]]  # a shared prefix


# ---- the boundary ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["gpu", "CPU", "cuda:", "cuda:x", "cuda:-1", " cpu", "mps", 0,
                                    None])
def test_a_bad_device_is_refused_naming_it(device: Any) -> None:
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'") as err:
        EngineConfig(device=device)
    assert repr(device) in str(err.value)


@pytest.mark.parametrize("given, kept", [("cpu", "cpu"), ("cuda", "cuda"), ("cuda:3", "cuda:3"),
                                         (torch.device("cpu"), "cpu"),
                                         (torch.device("cuda", 1), "cuda:1")])
def test_the_config_keeps_the_device_as_its_string(given: Any, kept: str) -> None:
    assert EngineConfig(device=given).device == kept


def test_cuda_without_cuda_is_one_clear_error_naming_the_device_and_the_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # so on a GPU machine too
    with pytest.raises(ValueError, match="torch.cuda.is_available") as err:
        LLM("builtin:tiny-llama", device="cuda:0", num_kv_blocks=8, max_model_len=64)
    assert "'cuda:0'" in str(err.value) and torch.__version__ in str(err.value)


def test_a_cuda_index_past_the_gpus_there_are_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"'cuda:2': torch sees 2 CUDA device\(s\)"):
        resolve_device("cuda:2")


def test_cuda_without_an_index_is_the_current_gpu_named_by_its_index(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The runner's thread (async scheduling) has a current device of its own: the engine's is
    # fixed where the engine is built.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_runner_refuses_a_device_other_than_its_weights() -> None:
    loaded = load_model("builtin:tiny-llama", torch.float32, device=META)
    assert loaded.model is not None
    with pytest.raises(ValueError, match="weights are on meta, the runner's device is cpu"):
        ModelRunner(loaded.model, loaded.config, 8, 16, torch.float32, device="cpu")


# ---- the CPU, however it is named -------------------------------------------------------------

def _generate(**kwargs: Any) -> tuple[list[Any], LLM]:
    llm = LLM("builtin:tiny-llama", num_kv_blocks=32, max_model_len=128,
              max_num_batched_tokens=24, **kwargs)  # chunked prefills, prefix hits
    params = [SamplingParams(max_tokens=3, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=3, temperature=0.9, top_p=0.9, seed=3),
              SamplingParams(max_tokens=3, temperature=1.0, top_k=5, seed=4)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.num_cached_tokens) for o in outs], llm


def test_the_cpu_named_any_way_gives_the_default_output_and_holds_everything_there() -> None:
    default, llm = _generate()
    llm.shutdown()
    for device in (torch.device("cpu"),):  # kept as "cpu" (test above): both names at once
        out, llm = _generate(device=device)
        try:
            assert out == default
            runner = llm.engine.runner
            assert llm.config.device == "cpu" and runner.device == torch.device("cpu")
            assert runner.kv_cache.device == runner.device
            assert {p.device for p in runner.model.parameters()} == {runner.device}
            llm.engine.add_request("g", [1, 2, 3], SamplingParams(max_tokens=2, seed=1))
            llm.engine.step()
            assert runner.requests["g"].generator.device == runner.device
            while llm.engine.has_pending_work():
                llm.engine.step()
            llm.engine.check_no_leaks()
        finally:
            llm.shutdown()


# ---- a step on another device builds everything there -----------------------------------------

def _steps_on(name: str, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        torch.Tensor]:
    """Schedules PROMPTS (chunked prefills, a prefix hit, decodes) with a CPU engine's scheduler
    and runs each step on a runner on `device`: every step's inputs, forward and logits there.
    Yields the logits of each step. The runner gets token 7 as each sampled token (meta tensors
    hold no values to sample from); the CPU engine's own runner runs nothing."""
    # A meta tensor has no generator; the sampler is checked on its own below.
    monkeypatch.setattr(runner_module, "make_generator",
                        lambda dev, seed: torch.Generator().manual_seed(seed))
    llm = LLM(name, num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=24)
    core = llm.engine
    loaded = load_model(name, torch.float32, device=device)
    model = loaded.model
    assert model is not None and model.device == device
    runner = ModelRunner(model, loaded.config, core.num_kv_blocks, core.config.block_size,
                         torch.float32, groups=core.runner.groups, device=device)
    assert runner.kv_cache.device == device
    try:
        for i, prompt in enumerate(PROMPTS):
            core.add_request(str(i), prompt, SamplingParams(max_tokens=3, temperature=0.0))
        while core.has_pending_work():
            sched = core.scheduler.schedule()
            runner._update_states(sched)
            out = ModelRunnerOutput()
            if sched.total_num_scheduled_tokens:
                batch = runner._prepare_inputs(sched)
                attn = (PagedStateAttention(runner.kv_cache, batch.attn_metadata,
                                            model.attention_scale, runner.block_size, None,
                                            runner.places)
                        if runner.model_config.mamba is not None else
                        PagedAttention(runner.kv_cache, batch.attn_metadata,
                                       model.attention_scale, None, runner.places))
                with torch.inference_mode():
                    hidden = model(batch.input_ids, batch.positions, attn, batch.logits_indices)
                    yield model.compute_logits(hidden)
                for rid in batch.sample_req_ids:
                    runner.requests[rid].token_ids.append(7)
                    out.sampled_token_ids[rid] = [7]
            core.scheduler.update_from_output(sched, out)
        core.check_no_leaks()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["builtin:tiny-llama", "builtin:tiny-gemma3",
                                  "builtin:tiny-granite4"])
def test_every_tensor_of_a_step_is_made_on_the_device_and_nothing_is_read_back(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = list(_steps_on(name, META, monkeypatch))
    assert len(logits) >= 4 and all(t.device == META for t in logits)


def test_the_sampler_reads_back_a_fixed_number_of_times_per_step_not_per_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    for name in ("tolist", "item", "numpy", "__int__", "__float__", "__iter__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _name: str = name, _f: Any = original) -> Any:
            reads.append(_name)
            return _f(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for rows in (1, 8):
        logits = torch.randn(rows, 50, generator=torch.Generator().manual_seed(rows))
        gens = [torch.Generator().manual_seed(i) for i in range(rows)]
        mixed = [SamplingParams(temperature=0.0 if i % 2 else 0.7, top_k=10, top_p=0.8, seed=i)
                 for i in range(rows)]
        reads.clear()
        sampler.sample(logits, mixed, gens)
        assert reads == ["tolist"]  # the token ids, once
        with_lp = [SamplingParams(temperature=0.0, logprobs=i % 3) for i in range(rows)]
        reads.clear()
        out = sampler.sample(logits, with_lp, gens)
        assert reads == ["tolist", "tolist"]  # ids, then values
        lp = torch.log_softmax(logits, -1)
        for i, entry in enumerate(out.logprobs):
            assert entry is not None and len(entry) >= 1
            assert entry[out.token_ids[i]] == pytest.approx(float(lp[i, out.token_ids[i]]))


class _NoDeviceMemory:
    """Stands in for the C library: any call means a tensor's memory reached C."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"{name} was handed tensors off the CPU")


def test_the_c_kernels_are_never_handed_device_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_library", lambda: _NoDeviceMemory())
    cache = torch.zeros(4, 2, 16, 2, 8, device=META)  # (blocks, K/V, block_size, heads, dim)
    k = v = torch.zeros(3, 2, 8, device=META)
    slots = torch.zeros(3, dtype=torch.long, device=META)
    assert kernels.store_kv(cache, slots, slots, k, v) is False
    q = torch.zeros(3, 4, 8, device=META)
    tables = torch.zeros(3, 1, dtype=torch.long, device=META)
    assert kernels.decode_attention(q, cache, tables, slots + 1, 0.5) is None


@pytest.mark.parametrize("queries, keys", [(1, 1), (3, 3), (5, 21), (16, 64)])
def test_the_explicit_mask_off_the_cpu_is_torchs_lower_right_causal_bias(queries: int,
                                                                         keys: int) -> None:
    # Off the CPU a prefill over cached context masks with window_mask(q, k, k) instead of
    # causal_lower_right (attention.py, _prefill_with_context): the same keys must be visible.
    bias = causal_lower_right(queries, keys)._materialize(torch.device("cpu"))
    assert torch.equal(window_mask(queries, keys, keys), bias)
