"""`kvtier generate | chat`: the command line over the LLM facade."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvtier.bench.cli import add_bench_args
from kvtier.engine.flags import add_engine_args, engine_knobs
from kvtier.errors import KvtierError
from kvtier.plan.cli import add_plan_args
from kvtier.server.cli import add_serve_args


def _sampling(args: argparse.Namespace) -> Any:
    from kvtier.sequence import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed_sampling,
        stop=args.stop or [],
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvtier.llm import LLM

    llm = LLM(args.model, **engine_knobs(args))
    start = time.perf_counter()
    out = llm.generate(args.prompt, _sampling(args))[0]
    elapsed = time.perf_counter() - start
    decode_s = out.metrics.decode_s or 0.0
    tps = (len(out.token_ids) - 1) / decode_s if decode_s > 0 and len(out.token_ids) > 1 else None
    if args.json:
        print(
            json.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "ttft_s": out.metrics.ttft_s,
                    "tokens_per_s": tps,
                    "finish_reason": out.finish_reason,
                    "elapsed_s": elapsed,
                }
            )
        )
    else:
        print(out.text)
        rate = f"{tps:.1f} tokens/s decode" if tps else "n/a"
        print(
            f"\n[{len(out.token_ids)} tokens, TTFT {out.metrics.ttft_s * 1e3:.0f} ms, {rate}, "
            f"model {llm.engine.model_source}]",
            file=sys.stderr,
        )
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from kvtier.llm import LLM

    llm = LLM(args.model, **engine_knobs(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvtier chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        out = llm.chat(messages, _sampling(args))[0]
        messages.append({"role": "assistant", "content": out.text})
        print(out.text)
        print(
            f"[TTFT {out.metrics.ttft_s * 1e3:.0f} ms, {out.num_cached_tokens} prompt tokens "
            "from the prefix cache]",
            file=sys.stderr,
        )


def _cmd_selftest(args: argparse.Namespace) -> int:
    from kvtier.bench.selftest import run_selftest
    from kvtier.model.loader import load_model

    loaded = load_model(args.model)
    report = run_selftest(loaded, conversations=args.conversations, turns=args.turns,
                          max_tokens=args.max_tokens, **engine_knobs(args))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(f"kvtier selftest on {loaded.source}: {report.conversations} conversations, "
              f"{report.turns} turns, {report.demoted_blocks} blocks demoted to host, "
              f"{report.restored_tokens} tokens restored, {report.blocks_compared} blocks "
              f"compared byte for byte, {report.restarts} restarts; warm turns by residency "
              f"{report.residency_counts()}")
        for line in report.token_mismatches + report.byte_mismatches:
            print(f"MISMATCH {line}")
        if report.restored_tokens == 0:
            print("FAIL: nothing was restored from host, so nothing was tested")
        print("PASS: warm (restored) runs equal cold ones" if report.ok else "FAIL")
    return 0 if report.ok else 1


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    out = export_hf(load_model(args.model), args.out, args.dtype)
    print(f"kvtier: wrote {out} (a Hugging Face model directory, {args.dtype})")
    return 0


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt")
    gen.add_argument("prompt")
    gen.add_argument(
        "--json", action="store_true", help="print text, token_ids, ttft_s, tokens_per_s"
    )
    _add_sampling_args(gen, 64)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)
    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat, 256)
    add_engine_args(chat)
    chat.set_defaults(func=_cmd_chat)
    add_bench_args(sub)
    add_plan_args(sub)
    add_serve_args(sub)
    selftest = sub.add_parser("selftest", help="cold vs warm: restored KV must be exact")
    selftest.add_argument("--conversations", type=int, default=4)
    selftest.add_argument("--turns", type=int, default=3)
    selftest.add_argument("--max-tokens", type=int, default=16)
    selftest.add_argument("--json", action="store_true")
    add_engine_args(selftest)
    selftest.set_defaults(func=_cmd_selftest)
    export = sub.add_parser("export-hf", help="write the model as a Hugging Face directory "
                            "(for vLLM): config.json, safetensors, tokenizer")
    export.add_argument("--model", default=None, help="GGUF, HF directory or preset "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    export.add_argument("--out", required=True, help="a new directory to write")
    export.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    export.set_defaults(func=_cmd_export_hf)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvtierError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
