"""Command line: the only reader of argv. ``seamline run | bench``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from seamline.errors import ConfigError, SeamlineError
from seamline.mesh.control.plan_args import add_plan_arguments
from seamline.server.api_options import add_api_arguments, api_options

INVITE_ENV = "SEAMLINE_INVITE"  # where `join` may read its invite (argv shows in `ps`)

BENCH_GROUP = "seamline.bench"  # the entry points of the benchmarks' own package (bench/)
BENCH_INSTALL = "./install.sh --bench (or pip install -e ./bench)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seamline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate on this machine (chat when no prompt is given)")
    run.add_argument("-p", "--prompt", help="one question; omit for an interactive chat")
    _add_model_args(run)
    _add_sampling_args(run)
    run.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    run.add_argument(
        "--verbose",
        action="store_true",
        help="after each answer: prompt and decode rates, time to first token, precision",
    )
    run.set_defaults(handler=cmd_run)
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
    bench.set_defaults(handler=cmd_bench)
    _add_mesh_commands(sub)
    return parser


def _tensor_parallel_arg(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--tensor-parallel N``, spelt as vLLM spells it too (``--tensor-parallel-size``, ``-tp``)."""
    parser.add_argument(
        "--tensor-parallel",
        "--tensor-parallel-size",
        "-tp",
        dest="tensor_parallel",
        type=int,
        default=0,
        metavar="N",
        help=help_text,
    )


def _add_serve_command(sub: Any) -> None:
    serve = sub.add_parser("serve", help="start a coordinator + OpenAI API (and a local node)")
    serve.add_argument(
        "--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2)"
    )
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="json: one JSON object a line",
    )
    _device_arg(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--control-port", type=int, default=0, help="node control port (default: port+1)"
    )
    serve.add_argument(
        "--fragments-port",
        type=int,
        default=0,
        help="fragment downloads, to members over mutual TLS (default: port+2)",
    )
    serve.add_argument(
        "--advertise", action="append", default=[], help="address nodes use to reach this host"
    )
    serve.add_argument(
        "--nodes-expected", type=int, default=1, help="wait for this many nodes before planning"
    )
    serve.add_argument(
        "--no-local-node", action="store_true", help="contribute no layers from this host"
    )
    serve.add_argument(
        "--single",
        action="store_true",
        help="no mesh: this process holds the whole model and batches concurrent requests",
    )
    _precision_args(serve)
    _speculation_args(serve)
    serve.add_argument("--context", type=int, default=0, help="context length (0: the model's own)")
    serve.add_argument("--invite-hours", type=float, default=24.0)
    serve.add_argument(
        "--state-dir",
        default=None,
        help="the mesh CA, invites and admin key (default: <cache>/mesh; `seamline invite` reads it)",
    )
    serve.add_argument(
        "--lock", help="pin the plan in this JSON file (from `seamline plan --lock`)"
    )
    _tensor_parallel_arg(
        serve, "N nodes compute each stage in lockstep (0: only where one node cannot hold a stage)"
    )
    serve.add_argument(
        "--transport",
        choices=("auto", "tcp", "torch"),
        default="auto",
        help="lockstep collectives: our TCP mesh, or torch.distributed (auto: NCCL with CUDA, else tcp)",
    )
    serve.add_argument(
        "--insecure-comm",
        action="store_true",
        help="allow --transport torch between hosts: gloo and NCCL encrypt nothing",
    )
    serve.add_argument(
        "--gate-timeout", type=float, default=30.0, help="seconds a lockstep rank waits at a gate"
    )
    serve.add_argument(
        "--replay-deadline",
        type=float,
        default=120.0,
        help="seconds a request whose node was lost waits for the mesh to serve again, then fails",
    )
    serve.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=3.0,
        help="seconds a node may stay silent before it is taken for lost (its requests replay)",
    )
    serve.add_argument(
        "--private",
        action="store_true",
        help="keep the embedding, the head and sampling on this machine's own node (the route's two "
        "ends): members hold only layers between and see no token id, prompt or answer",
    )
    serve.add_argument(
        "--verify-fraction",
        type=_fraction,
        default=0.0,
        help="follow this fraction of requests through the coordinator's own copy of the model, "
        "holding their tokens until they check out (0: only the start-up check)",
    )
    serve.add_argument(
        "--kv-cache-memory",
        type=float,
        default=0.0,
        help="GiB of KV cache the first stage (or --single) admits requests into "
        "(0: 80%% of the memory free at start); a request that cannot fit is refused",
    )
    add_api_arguments(serve)
    serve.add_argument(
        "--micro-batches",
        type=_at_least_zero,
        default=0,
        help="micro-batches in flight in the pipeline (default and least: one per stage)",
    )
    serve.set_defaults(handler=cmd_serve)


def _add_mesh_commands(sub: Any) -> None:
    _add_serve_command(sub)
    join = sub.add_parser("join", help="join a mesh as a node")
    join.add_argument(
        "token",
        nargs="?",
        default=None,
        help=f"the invite (better: --token-file, or ${INVITE_ENV}: argv shows in `ps`)",
    )
    join.add_argument("--token-file", default=None, help="read the invite from this file")
    join.add_argument("--max-memory", type=float, default=None, help="GB this node may use")
    join.add_argument("--node-id", default=None)
    join.add_argument("--data-port", type=int, default=0)
    join.add_argument("--quiet", action="store_true", help="log warnings only")
    join.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="json: one JSON object a line",
    )
    join.add_argument("--no-progress", action="store_true", help="no download progress bar")
    join.add_argument(
        "--reprobe-when-idle",
        action="store_true",
        help="take the stage's speed probe again once it is idle and its cores quiet (for predictions)",
    )
    _device_arg(join)
    join.set_defaults(handler=cmd_join)
    demo = sub.add_parser(
        "demo", help="a coordinator and N nodes on this machine answer one question"
    )
    demo.add_argument("--nodes", type=int, default=2)
    demo.add_argument("--model", default=None)
    # a question the embedded model answers on a wide margin at every precision (its first token
    # for the capital of France is a near tie that int8 activations flip: README, Precision)
    demo.add_argument("-p", "--prompt", default="What is the capital of Japan?")
    demo.add_argument("--max-tokens", type=int, default=64)
    _precision_args(demo)
    _tensor_parallel_arg(demo, "N nodes per stage, in lockstep")
    demo.set_defaults(handler=cmd_demo)
    package = sub.add_parser("package", help="split a checkpoint into per-layer fragments")
    package.add_argument("model")
    package.add_argument("--out", required=True)
    package.set_defaults(handler=cmd_package)
    plan = sub.add_parser(
        "plan", help="print the layer plan for a pool of nodes, and its predictions under load"
    )
    add_plan_arguments(plan)
    _tensor_parallel_arg(
        plan, "N nodes per stage in lockstep (0: groups only where no node holds a stage)"
    )
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
    actions = invite.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="a new invite token")
    create.add_argument(
        "--uses", type=int, default=None, help="nodes it may admit (default: any number)"
    )
    create.add_argument("--expires", default="24h", help="lifetime: 90s, 30m, 1h, 7d (default 24h)")
    actions.add_parser("list", help="every invite, its uses and state")
    revoke = actions.add_parser("revoke", help="no node joins with it from now on")
    revoke.add_argument("id")
    node = sub.add_parser("node", help="manage a running mesh's members")
    node_actions = node.add_subparsers(dest="action", required=True)
    remove = node_actions.add_parser(
        "remove", help="eject a member: its certificate revoked, its links dropped"
    )
    remove.add_argument("id")
    for parser in (create, actions.choices["list"], revoke, remove):
        parser.add_argument(
            "--state-dir", default=None, help="the coordinator's state (default: <cache>/mesh)"
        )
        parser.add_argument(
            "--url", default=None, help="the coordinator's API (default: from the state directory)"
        )
    invite.set_defaults(handler=cmd_admin, handler_name="invite")
    node.set_defaults(handler=cmd_admin, handler_name="node")


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _precision_args(p: argparse.ArgumentParser) -> None:
    from seamline.precision import FLOAT_NAMES, PRECISIONS

    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fast",
        help="fast: quantized weights with bfloat16 activations and int8 blocks in the matmuls, as "
        "llama.cpp; exact: float32, the dequantised model's answers (default: fast)",
    )
    p.add_argument(
        "--dtype",
        choices=FLOAT_NAMES,
        default=None,
        help="activation dtype, overriding the precision's (fast: bfloat16 for quantized weights, "
        "else the weights' own; exact: float32)",
    )


def _speculation_args(p: argparse.ArgumentParser) -> None:
    from seamline.runtime.speculation import DRAFT_MAX, MODES

    p.add_argument(
        "--speculative",
        choices=MODES,
        default="auto",
        help="draft tokens and verify them in the decode step: the output is the same, sooner when "
        "drafts are right (auto: what the model offers: DeepSeek-V3's multi-token-prediction layer where "
        "the checkpoint has it and one process serves, else n-grams of the prompt and answer)",
    )
    p.add_argument(
        "--draft-max", type=int, default=DRAFT_MAX, help="the most tokens one window drafts"
    )
    p.add_argument(
        "--draft-model",
        metavar="PATH",
        default=None,
        help="a smaller model with the same vocabulary drafts (one process: run, serve --single)",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=None,
        help='as vLLM takes it: {"method": "ngram"|"mtp"|"deepseek_mtp", "num_speculative_tokens": N} '
        'or {"model": PATH, ...}, in place of --speculative, --draft-max and --draft-model',
    )


def _speculation(args: argparse.Namespace) -> Any:
    from dataclasses import replace

    from seamline.runtime.speculation import Speculation, from_config

    if args.speculative_config is not None:
        chosen = from_config(args.speculative_config)
        return chosen if args.draft_model is None else replace(chosen, draft_model=args.draft_model)
    return Speculation(args.speculative, args.draft_max, draft_model=args.draft_model)


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="auto",
        help="where the model computes: auto (CUDA when torch sees it, else the CPU), cpu, cuda, cuda:N, mps",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2)")
    _precision_args(p)
    _device_arg(p)
    _speculation_args(p)
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
        "rounds": args.rounds,
    }  # each benchmark takes its own
    run_bench(args.name, args.json_path, **options)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from seamline.mesh.control.serve import ServeOptions
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
    options = ServeOptions(
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
        private=args.private,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        kv_cache_bytes=_gib(args.kv_cache_memory),
        speculation=speculation,
        device=args.device,
    )
    api = api_options(args)
    return run_serve(replace(options, tls_certificate=api.certificate_pem()), api)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction is in [0, 1], not {text}")
    return value


def _gib(value: float) -> int:
    return int(value * (1 << 30))


def cmd_join(args: argparse.Namespace) -> int:
    from seamline.runtime.openmp import node_spin

    node_spin()  # before torch loads: the next import brings it
    from seamline.mesh.node.process import NodeOptions, run_node
    from seamline.model.devices import resolve_device
    from seamline.net.http_guard import raise_descriptor_limit

    _logging(quiet=args.quiet, fmt=args.log_format)
    raise_descriptor_limit()
    resolve_device(args.device)  # a device this machine lacks: one line now, not after the download
    options = NodeOptions(
        data_port=args.data_port,
        progress=not args.no_progress,
        device=args.device,
        reprobe_when_idle=args.reprobe_when_idle,
    )
    if args.max_memory is not None:
        options.max_memory_bytes = int(args.max_memory * (1 << 30))
    if args.node_id:
        options.node_id = args.node_id
    return run_node(_invite_token(args), options)


def _invite_token(args: argparse.Namespace) -> str:
    """The invite from argv, a file, or the environment (exactly one of them)."""
    import os

    given = [
        (what, value)
        for what, value in (
            ("the command line", args.token),
            ("--token-file", args.token_file),
            (f"${INVITE_ENV}", os.environ.get(INVITE_ENV)),
        )
        if value
    ]
    if len(given) != 1:
        where = " and ".join(what for what, _ in given) or "nowhere"
        raise SeamlineError(
            f"give the invite token once (argv, --token-file or ${INVITE_ENV}); got it from {where}"
        )
    what, value = given[0]
    if what == "--token-file":
        try:
            value = Path(value).read_text()
        except OSError as exc:
            raise SeamlineError(f"cannot read the invite token file: {exc}") from None
    return value.strip()


def cmd_admin(args: argparse.Namespace) -> int:
    """`seamline invite create|list|revoke` and `seamline node remove`."""
    from seamline.mesh.control.admin_client import (
        AdminClient,
        default_state_dir,
        format_invites,
        parse_duration,
    )

    client = AdminClient(Path(args.state_dir) if args.state_dir else default_state_dir(), args.url)
    if args.handler_name == "node":
        client.call("DELETE", f"nodes/{args.id}")
        print(f"removed node {args.id}")
        for invite in client.call("GET", "invites")[
            "invites"
        ]:  # removal revokes the invite it joined with
            if args.id in invite.get("nodes", ()) and invite["state"] == "revoked":
                print(
                    f"revoked invite {invite['id']}, which it joined with: new nodes need a new invite "
                    "(seamline invite create)"
                )
    elif args.action == "create":
        made = client.call(
            "POST", "invites", {"uses": args.uses, "expires_s": parse_duration(args.expires)}
        )
        print(
            f"invite {made['id']} ({'any number of' if args.uses is None else args.uses} uses, "
            f"expires in {args.expires}):\n{made['token']}"
        )
    elif args.action == "list":
        print(format_invites(client.call("GET", "invites")["invites"]))
    else:
        client.call("DELETE", f"invites/{args.id}")
        print(f"revoked invite {args.id}")
    return 0


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


def cmd_package(args: argparse.Namespace) -> int:
    from seamline.weights.packaging import package

    manifest = package(args.model, args.out)
    total = sum(f.bytes for f in manifest.fragments)
    print(
        f"{len(manifest.fragments)} fragments, {total / 1e6:.1f} MB, model hash {manifest.model_hash[:16]} in {args.out}"
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import os

    from seamline.server.status_cli import fetch_summary

    print(fetch_summary(args.url, args.api_key or os.environ.get("SEAMLINE_API_KEY")))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from seamline.mesh.control.plan_args import plan_sim_options
    from seamline.mesh.control.plan_cli import run_plan_command

    return run_plan_command(
        args.nodes_json,
        args.model,
        args.lock,
        args.context,
        args.batch,
        live_url=args.live,
        tensor_parallel=args.tensor_parallel,
        objective=args.objective,
        sim=plan_sim_options(args),
    )


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
