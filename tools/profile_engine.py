"""Where the reference engine's decode steps and prefills spend their time (torch.profiler).

    python tools/profile_engine.py [--model builtin:smollm2-135m] [--dtype float32]
                                   [--batches 1,8,32] [--prefill 2048] [--unpacked]

For each decode batch it runs requests of 128-token prompts into steady decoding and profiles
10 steps; for the prefill, one prompt of that many tokens (one chunk). Every torch op is put in
one of these groups, per step, in milliseconds:

    projections   the q/k/v, o, gate/up and down matmuls of every layer (torch's or the native
                  small matmul's)
    logits head   the (vocab x hidden) matmul of the sampled rows
    attention     K/V written into the pool, decode attention (the native kernel, or torch's
                  gather and SDPA), prefill SDPA
    other ops     norms, RoPE, activations, residual adds, views, copies, sampling
    engine        the rest of the step's wall time: scheduler, input preparation, Python

`--unpacked` keeps torch's own linear (no oneDNN prepacking), to compare with the engine before
kvport.model.linear. The summary goes to stdout as a Markdown table (docs/engine-speed.md).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvport import LLM, SamplingParams
from kvport.model.llama import LlamaForCausalLM

try:
    from kvport.model import kernels
except ImportError:  # kvport from before the native kernels (PYTHONPATH=<old>/src)
    kernels = None  # type: ignore[assignment]

MATMULS = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"}
ATTENTION = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select",
             "aten::_index_put_impl_", "aten::_scaled_dot_product_attention_math"}
GROUPS = ("projections", "logits head", "attention", "other ops", "engine")
# The native kernels are ctypes calls, invisible to the profiler: named ranges around them.
NATIVE = {"kvport::decode_attention": "attention", "kvport::store_kv": "attention",
          "kvport::small_matmul": "projections", "kvport::small_matmul_head": "logits head"}


def _name_native_kernels(vocab: int) -> None:
    def named(fn, name_of):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            with record_function(name_of(args)):
                return fn(*args)
        return call

    if kernels is None:
        return
    for fn in ("decode_attention", "store_kv"):
        if hasattr(kernels, fn):
            setattr(kernels, fn, named(getattr(kernels, fn), lambda _, fn=fn: f"kvport::{fn}"))
    if hasattr(kernels, "small_matmul"):
        kernels.small_matmul = named(kernels.small_matmul, lambda args: "kvport::small_matmul"
                                     + ("_head" if args[3] == vocab else ""))


def group_times(prof: profile, vocab: int, steps: int) -> dict[str, float]:
    """Self CPU time per group, ms per step (the engine group is filled in by the caller)."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages(group_by_input_shape=True):
        ms = ev.self_cpu_time_total / 1e3 / steps
        if ev.key in NATIVE:
            out[NATIVE[ev.key]] += ms
        elif ev.key in MATMULS:
            head = any(vocab in shape for shape in ev.input_shapes if shape)
            out["logits head" if head else "projections"] += ms
        elif ev.key in ATTENTION:
            out["attention"] += ms
        elif ev.key.startswith("aten::") or ev.key.startswith("mkldnn::"):
            out["other ops"] += ms
    return out


def profile_decode(llm: LLM, batch: int, vocab: int, steps: int = 10) -> dict[str, float]:
    eng = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=steps * 3 + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"p{batch}-{i}", [rng.randrange(100, vocab - 100) for _ in range(128)],
                        params)
    for _ in range(4):  # the prefill, then steady decoding
        eng.step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = (time.perf_counter() - start) * 1e3 / steps
    while eng.has_pending_work():
        eng.step()
    return _with_engine(group_times(prof, vocab, steps), wall)


def profile_prefill(llm: LLM, length: int, vocab: int) -> dict[str, float]:
    rng = random.Random(length)
    prompt = [rng.randrange(100, vocab - 100) for _ in range(length)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt[::-1]], params, use_tqdm=False)  # warm: same shapes, other tokens
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = (time.perf_counter() - start) * 1e3
    return _with_engine(group_times(prof, vocab, 1), wall)


def _with_engine(groups: dict[str, float], wall_ms: float) -> dict[str, float]:
    groups["engine"] = max(0.0, wall_ms - sum(groups.values()))
    groups["total"] = wall_ms
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--unpacked", action="store_true", help="torch's linear, no prepacking")
    args = p.parse_args()
    if args.unpacked:
        LlamaForCausalLM.pack_weights = lambda self: None  # type: ignore[method-assign]
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=args.prefill + 64, max_num_seqs=64,
              max_num_batched_tokens=max(args.prefill, 2048))
    vocab = llm.engine.loaded.config.vocab_size
    _name_native_kernels(vocab)
    rows = [(f"decode b={b}", profile_decode(llm, int(b), vocab))
            for b in args.batches.split(",")]
    rows.append((f"prefill {args.prefill}", profile_prefill(llm, args.prefill, vocab)))
    llm.shutdown()
    kind = "torch linear" if args.unpacked else "packed"
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} threads, {kind}; "
          "ms per step (share)")
    print("| step | total | " + " | ".join(GROUPS) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in GROUPS) + " |")
    for name, g in rows:
        cells = [f"{g[k]:.1f} ({g[k] / g['total']:.0%})" for k in GROUPS]
        print(f"| {name} | {g['total']:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
