"""`kvport` command line: generate, bench, trace, conformance."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from kvport.config import DEFAULT_KV_CONNECTOR_CALL_ORDER  # both light: no torch
from kvport.trace.events import CALL_ORDERS


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:tiny-llama",
                   help="builtin:NAME (tiny-llama, smollm2-135m, tiny-gemma3, tiny-granite4; "
                        "for benchmarks small-gemma3, small-granite4) or a Hugging Face-format "
                        "directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu",
                   help="cpu (default), cuda or cuda:N: where the model, KV pool and sampler run")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's own limit, "
                        "capped by the KV pool)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule step N+1 while step N runs")
    p.add_argument("--worker", default="inproc", choices=["inproc", "process"],
                   help="run the model runner in this process or in a child process")
    p.add_argument("--kv-transfer-config", default=None,
                   help='KV connector config as JSON, e.g. \'{"kv_connector": "ExampleConnector", '
                        '"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}\'')
    p.add_argument("--kv-connector-call-order", default=DEFAULT_KV_CONNECTOR_CALL_ORDER,
                   choices=CALL_ORDERS,
                   help="the order of the KV connector's worker hooks: vLLM 0.32's (start_load_kv "
                        "after the forward unless the step loads synchronously, wait_for_save on "
                        "every step), Model Runner V2's (vllm-mrv2: finish_forward after the "
                        "forward, then the same) or the legacy one (vLLM before 0.32)")
    p.add_argument("--seed", type=int, default=0)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return dict(
        dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
        async_scheduling=args.async_scheduling, worker=args.worker,
        kv_transfer_config=args.kv_transfer_config,
        kv_connector_call_order=args.kv_connector_call_order,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from kvport import LLM, SamplingParams

    prompts: list[str] = list(args.prompt or [])
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts.extend(line.rstrip("\n") for line in f if line.strip())
    if not prompts:
        prompts = ["The capital of France is"]
    llm = LLM(model=args.model, **_engine_kwargs(args))
    shown = list(prompts)  # what the user typed, not the chat-template text around it
    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for text, out in zip(shown, outs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({
                "prompt": text, "text": c.text, "token_ids": c.token_ids,
                "finish_reason": c.finish_reason, "num_cached_tokens": out.num_cached_tokens,
                "ttft_s": out.metrics.time_to_first_token, "e2e_s": out.metrics.e2e_latency,
            }))
        else:
            print(f"--- prompt: {text!r}")
            print(c.text)
            print(f"--- {len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
                  f"ttft={out.metrics.time_to_first_token:.3f}s")
    llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvport", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with the reference engine")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    gen.add_argument("--prompt-file", help="file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=cmd_generate)

    from kvport.bench.cli import add_bench_parser
    from kvport.conformance.cli import add_conformance_parser
    from kvport.trace.cli import add_trace_parser

    add_bench_parser(sub)
    add_trace_parser(sub)
    add_conformance_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvport: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
