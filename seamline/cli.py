"""Command line: the only reader of argv. ``seamline run | bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from typing import Any

from seamline.errors import SeamlineError

BENCHES = ("single",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seamline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate on this machine (chat when no prompt is given)")
    run.add_argument("-p", "--prompt", help="one question; omit for an interactive chat")
    _add_model_args(run)
    _add_sampling_args(run)
    run.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    run.set_defaults(handler=cmd_run)
    bench = sub.add_parser("bench", help="run a benchmark and write its JSON")
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("--json", dest="json_path", help="write the result JSON here")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--tokens", type=int, default=128)
    bench.set_defaults(handler=cmd_bench)
    return parser


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--context", type=int, default=0, help="context length (0: the model's own)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def set_threads(threads: int) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


def cmd_run(args: argparse.Namespace) -> int:
    from seamline.app import LocalModel

    set_threads(args.threads)
    model = LocalModel.load(args.model, args.dtype, args.context or None)
    if args.prompt is not None:
        messages = [{"role": "user", "content": args.prompt}]
        _stream(model, messages, args, raw=args.raw)
        return 0
    return _chat(model, args)


def _stream(model: Any, messages: list[dict[str, str]], args: argparse.Namespace, raw: bool) -> str:
    from seamline.runtime.sampling import SamplingParams
    from seamline.text import StreamDecoder

    codec = model.codec
    prompt = codec.encode(messages[-1]["content"]) if raw else codec.encode_chat(messages)
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        seed=args.seed, max_tokens=args.max_tokens, stop_token_ids=codec.stop_ids,
        stop_strings=tuple(args.stop),
    )  # fmt: skip
    decoder = StreamDecoder(codec, params.stop_strings)
    pieces: list[str] = []
    for token in model.engine.generate(prompt, params):
        pieces.append(_show(decoder.push(token)))
        if decoder.stopped:
            break
    pieces.append(_show(decoder.flush()))
    print(flush=True)
    return "".join(pieces)


def _show(piece: str) -> str:
    sys.stdout.write(piece)
    sys.stdout.flush()
    return piece


def _lines(prompt: str) -> Iterator[str]:
    while True:
        try:
            yield input(prompt)
        except EOFError:
            return


def _chat(model: Any, args: argparse.Namespace) -> int:
    print("seamline chat: type a message, /exit or Ctrl-D to leave.", file=sys.stderr)
    messages: list[dict[str, str]] = []
    for line in _lines("> "):
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        answer = _stream(model, messages, args, raw=False)
        messages.append({"role": "assistant", "content": answer})
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from seamline.bench import run_bench

    run_bench(args.name, args.json_path, repeats=args.repeats, tokens=args.tokens)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except SeamlineError as exc:
        print(f"seamline: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
