"""Command line: the only reader of argv. ``seamline run | bench``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seamline.cli_args import model_args, sampling_args
from seamline.cli_mesh_args import (
    admin_args,
    demo_args,
    join_args,
    plan_args,
    serve_compute_args,
    serve_host_args,
    serve_mesh_args,
    serve_pipeline_args,
    serve_request_args,
)
from seamline.cli_mesh_commands import cmd_admin, cmd_join, cmd_package, cmd_plan
from seamline.errors import ConfigError, SeamlineError
from seamline.server.api_options import add_api_arguments, api_options

if TYPE_CHECKING:
    from seamline.mesh.control.serve import ServeOptions
    from seamline.runtime.speculation import Speculation

BENCH_GROUP = "seamline.bench"  # the entry points of the benchmarks' own package (bench/)
BENCH_INSTALL = "./install.sh --bench (or pip install -e ./bench)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seamline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate on this machine (chat when no prompt is given)")
    run.add_argument("-p", "--prompt", help="one question; omit for an interactive chat")
    model_args(run)
    sampling_args(run)
    run.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    run.add_argument(
        "--verbose",
        action="store_true",
        help="after each answer: prompt and decode rates, time to first token, precision",
    )
    run.set_defaults(handler=cmd_run)
    _add_bench_command(sub)
    _add_mesh_commands(sub)
    return parser


def _add_bench_command(sub: Any) -> None:
    bench = sub.add_parser("bench", help="run a benchmark and write its JSON")
    names = _bench_entry("names")
    bench.add_argument(
        "name",
        choices=sorted(names) if names else None,
        help=None if names else f"the benchmarks are not installed: {BENCH_INSTALL}",
    )
    bench.add_argument("--json", dest="json_path", help="write the result JSON here")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--tokens", type=int, default=128)
    bench.add_argument(
        "--inputs", type=int, default=0, help="fuzz: inputs per surface (default 100000)"
    )
    bench.add_argument(
        "--rounds", type=int, default=0, help="chaos: failures to cause (default 20)"
    )
    bench.add_argument(
        "--only",
        choices=("surfaces", "attacks"),
        default=None,
        help="fuzz: only the generated inputs per surface, or only the known attacks on a live mesh",
    )
    bench.add_argument(
        "--attacks",
        default=None,
        help="fuzz: of the known attacks only these, comma-separated (say, with --only attacks)",
    )
    bench.set_defaults(handler=cmd_bench)


def _add_serve_command(sub: Any) -> None:
    """``serve``'s arguments, group by group (``cli_mesh_args``), the API's among them."""
    serve = sub.add_parser("serve", help="start a coordinator + OpenAI API (and a local node)")
    serve_host_args(serve)
    serve_compute_args(serve)
    serve_mesh_args(serve)
    serve_request_args(serve)
    add_api_arguments(serve)
    serve_pipeline_args(serve)
    serve.set_defaults(handler=cmd_serve)


def _add_mesh_commands(sub: Any) -> None:
    _add_serve_command(sub)
    join = sub.add_parser("join", help="join a mesh as a node")
    join_args(join)
    join.set_defaults(handler=cmd_join)
    demo = sub.add_parser(
        "demo", help="a coordinator and N nodes on this machine answer one question"
    )
    demo_args(demo)
    demo.set_defaults(handler=cmd_demo)
    package = sub.add_parser("package", help="split a checkpoint into per-layer fragments")
    package.add_argument("model")
    package.add_argument("--out", required=True)
    package.set_defaults(handler=cmd_package)
    plan = sub.add_parser(
        "plan", help="print the layer plan for a pool of nodes, and its predictions under load"
    )
    plan_args(plan)
    plan.set_defaults(handler=cmd_plan)
    _add_admin_commands(sub)


def _add_admin_commands(sub: Any) -> None:
    status = sub.add_parser("status", help="a running server's nodes, requests and events")
    status.add_argument("url", help="the server's address, e.g. http://127.0.0.1:8000")
    status.add_argument(
        "--api-key", default=None, help="the key the server asks (default: $SEAMLINE_API_KEY)"
    )
    status.set_defaults(handler=cmd_status)
    invite = sub.add_parser("invite", help="create, list or revoke invites to a running mesh")
    node = sub.add_parser("node", help="manage a running mesh's members")
    admin_args(invite, node)
    invite.set_defaults(handler=cmd_admin, handler_name="invite")
    node.set_defaults(handler=cmd_admin, handler_name="node")


def _speculation(args: argparse.Namespace) -> Speculation:
    from seamline.runtime.speculation import Speculation, from_config

    if args.speculative_config is not None:
        chosen = from_config(args.speculative_config)
        return chosen if args.draft_model is None else replace(chosen, draft_model=args.draft_model)
    return Speculation(args.speculative, args.draft_max, draft_model=args.draft_model)


def set_threads(threads: int) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


def cmd_run(args: argparse.Namespace) -> int:
    from seamline.server.serve_local import local_backend

    set_threads(args.threads)
    # the one-process backend `serve --single` serves with: one loop, one way to draw and end
    backend, model = local_backend(
        args.model,
        args.dtype,
        args.context or None,
        0,
        args.precision,
        _speculation(args),
        device=args.device,
    )
    try:
        if args.prompt is not None:
            _stream(model, backend, [{"role": "user", "content": args.prompt}], args, raw=args.raw)
            return 0
        return _chat(model, backend, args)
    finally:
        backend.close()


def _stream(
    model: Any, backend: Any, messages: list[dict[str, str]], args: argparse.Namespace, raw: bool
) -> str:
    """Print the answer as it comes and return it: the API's ``Generation`` (stop strings, the
    backend's finish reason) over ``backend``; the parameters are checked here, at the edge."""
    from seamline.params import SamplingParams
    from seamline.server.generation import Generation
    from seamline.server.metrics import Metrics, RequestMeter
    from seamline.timings import Timings

    codec = model.codec
    prompt = codec.encode_prompt(messages[-1]["content"]) if raw else codec.encode_chat(messages)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop_token_ids=codec.stop_ids,
        stop_strings=tuple(args.stop),
    )
    params.validate()
    model.engine.check_prompt(prompt)
    timings = Timings(len(prompt))

    async def show() -> str:
        generation = Generation(backend, prompt, params, RequestMeter(Metrics()))
        pieces = []
        async for piece in generation.pieces():
            if piece.token is not None:
                timings.token()
            pieces.append(_show(piece.text))
        return "".join(pieces)

    answer = asyncio.run(show())
    print(flush=True)
    if args.verbose:
        print(timings.report(model.precision.describe()), file=sys.stderr, flush=True)
    return answer


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


def _chat(model: Any, backend: Any, args: argparse.Namespace) -> int:
    print("seamline chat: type a message, /exit or Ctrl-D to leave.", file=sys.stderr)
    messages: list[dict[str, str]] = []
    for line in _lines("> "):
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        answer = _stream(model, backend, messages, args, raw=False)
        messages.append({"role": "assistant", "content": answer})
    return 0


BENCH_EXTRAS = ("openai", "transformers")  # the benchmarks' client and reference, not the server's


def _bench_entry(name: str) -> Any:
    """The benchmarks' entry point ``name`` ("run", "names") loaded, or None where the package
    is not installed (seamline serves without it)."""
    from importlib.metadata import entry_points

    found = entry_points(group=BENCH_GROUP, name=name)
    return next(iter(found)).load() if found else None


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    run_bench = _bench_entry("run")
    if run_bench is None:
        raise SeamlineError(
            f"the benchmarks are a package of their own, not installed: {BENCH_INSTALL}"
        )
    for module in BENCH_EXTRAS:
        try:
            importlib.import_module(module)
        except ImportError:
            raise SeamlineError(
                f"the benchmarks need {module}, which the server does not: {BENCH_INSTALL}"
            ) from None
    options = {
        "repeats": args.repeats,
        "tokens": args.tokens,
        "inputs_per_surface": args.inputs,
        "only": args.only,
        "attacks": tuple(args.attacks.split(",")) if args.attacks else None,
        "rounds": args.rounds,
    }  # each benchmark takes its own
    run_bench(args.name, args.json_path, **options)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from seamline.net.http_guard import raise_descriptor_limit
    from seamline.server.mesh_app import run_serve

    _logging(quiet=False, fmt=args.log_format)
    raise_descriptor_limit()  # a server's connections are its descriptors
    if args.single:
        from seamline.server.serve_local import serve_local

        serve_local(
            args.model,
            args.host,
            args.port,
            args.dtype,
            args.context or None,
            _gib(args.kv_cache_memory),
            api_options(args),
            precision=args.precision,
            speculation=_speculation(args),
            device=args.device,
        )
        return 0
    options = _mesh_options(args, _mesh_speculation(args))
    api = api_options(args)
    return run_serve(replace(options, tls_certificate=api.certificate_pem()), api)


def _mesh_speculation(args: argparse.Namespace) -> Speculation:
    """The speculation asked for, refused where a mesh cannot draft that way."""
    speculation = _speculation(args)
    if speculation.draft_model is not None:
        raise ConfigError(
            "--draft-model drafts on one process (run, serve --single); a mesh drafts n-grams "
            "or with the model's multi-token-prediction layer"
        )
    if speculation.mode in ("ngram", "mtp") and (args.private or args.verify_fraction > 0):
        raise ConfigError(
            f"--speculative {speculation.mode}: a mesh speculates only where every row is not checked and members "
            "see the tokens (not with --private or --verify-fraction)"
        )
    return speculation


def _mesh_options(args: argparse.Namespace, speculation: Speculation) -> ServeOptions:
    from seamline.mesh.control.serve import ServeOptions

    return ServeOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        control_port=args.control_port,
        fragments_port=args.fragments_port,
        advertise=tuple(args.advertise),
        nodes_expected=args.nodes_expected,
        local_node=not args.no_local_node,
        dtype=args.dtype,
        precision=args.precision,
        context=args.context,
        invite_ttl_s=args.invite_hours * 3600,
        lock_path=args.lock,
        tensor_parallel=args.tensor_parallel,
        transport=args.transport,
        gate_timeout_s=args.gate_timeout,
        micro_batches=args.micro_batches,
        replay_deadline_s=args.replay_deadline,
        heartbeat_timeout_s=args.heartbeat_timeout,
        insecure_comm=args.insecure_comm,
        verify_fraction=args.verify_fraction,
        verify_node=args.verify_node,
        private=args.private,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        kv_cache_bytes=_gib(args.kv_cache_memory),
        speculation=speculation,
        device=args.device,
    )


def _gib(value: float) -> int:
    return int(value * (1 << 30))


def cmd_demo(args: argparse.Namespace) -> int:
    from seamline.server.demo import run_demo

    _logging(quiet=True)
    return run_demo(
        args.nodes,
        args.prompt,
        args.model,
        args.max_tokens,
        tensor_parallel=args.tensor_parallel,
        precision=args.precision,
        dtype=args.dtype,
    )


def cmd_status(args: argparse.Namespace) -> int:
    import os

    from seamline.server.status_cli import fetch_summary

    print(fetch_summary(args.url, args.api_key or os.environ.get("SEAMLINE_API_KEY")))
    return 0


def _logging(quiet: bool, fmt: str = "text") -> None:
    from seamline.logs import setup_logging

    setup_logging(quiet, fmt)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        if argv is None and args.command in (
            "serve",
            "join",
        ):  # a program's start, not a call in a test
            from seamline.allocator import restart_with_allocator

            restart_with_allocator()  # returns where it need not (or cannot) preload one
        return handler(args)
    except SeamlineError as exc:
        print(f"seamline: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
