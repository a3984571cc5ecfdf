"""`pagedllm generate | chat | serve | download | models | env | simulate | dashboard | docs` on the command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from pagedllm.entrypoints.engine_flags import add_engine_args, engine_args_from_cli
from pagedllm.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--n", type=int, default=1)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )


def run_generate(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    params = sampling_params_from(args)
    llm = LLM.from_engine_args(engine_args_from_cli(args))
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    for output in outputs:
        for completion in output.outputs:
            label = f"[{output.request_id}.{completion.index}]" if params.n > 1 else f"[{output.request_id}]"
            print(f"{label} {output.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(
        f"{len(outputs)} requests, {num_tokens} output tokens in {elapsed:.2f} s: "
        f"{len(outputs) / elapsed:.2f} req/s, {num_tokens / elapsed:.1f} output tok/s"
    )
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    params = sampling_params_from(args)
    llm = LLM.from_engine_args(engine_args_from_cli(args))
    conversation: list[dict[str, str]] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            user = input("you> ")
        except EOFError:
            break
        if not user.strip():
            break
        conversation.append({"role": "user", "content": user})
        reply = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
        print(f"assistant> {reply}", flush=True)
        conversation.append({"role": "assistant", "content": reply})
    return 0


def run_env(args: argparse.Namespace) -> int:
    from pagedllm.kernels.report import format_report, kernel_report

    report = kernel_report()
    if args.model is not None:
        # Where layers run depends on the weights' formats and the family's ops, so the model is
        # loaded as the engine loads it (the same flags), with the smallest KV pool.
        from pagedllm.engine.llm_engine import LLMEngine

        engine_args = engine_args_from_cli(args)
        if engine_args.kv_cache_memory is None and engine_args.num_kv_blocks is None:
            engine_args.num_kv_blocks = 16
        engine = LLMEngine.from_engine_args(engine_args)
        report["layers"] = engine.layer_placement
        engine.shutdown()
    text = format_report(report)
    if "layers" in report:
        text += f"\nLayers           {report['layers']}"
    print(json.dumps(report, indent=2) if args.json else text)
    return 0 if report["level"] is not None else 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference on a paged KV cache")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts offline and print a throughput summary")
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=run_generate)
    chat = sub.add_parser("chat", help="interactive multi-turn chat on the terminal")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=run_chat)
    try:
        from pagedllm.entrypoints.serve_cli import add_serve_parser
    except ImportError:  # the server's dependencies are optional for offline use
        pass
    else:
        add_serve_parser(sub)
    from pagedllm.entrypoints.hub_cli import add_hub_parsers

    add_hub_parsers(sub)
    env = sub.add_parser("env", help="the CPU, the kernel level in use and why, each kernel's branch, torch and "
                                     "oneDNN; with --model, where that model's layers run")
    env.add_argument("--json", action="store_true", help="as JSON, for scripts")
    # Without --model nothing loads: the kernel report alone.
    add_engine_args(env)
    env.set_defaults(func=run_env)
    from pagedllm.entrypoints.simulate_cli import add_simulate_parser

    add_simulate_parser(sub)
    from pagedllm.entrypoints.dashboard.cli import add_dashboard_parser

    add_dashboard_parser(sub)
    from pagedllm.entrypoints.docs_cli import add_docs_parser

    add_docs_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
