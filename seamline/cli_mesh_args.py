"""The mesh commands' arguments: ``serve`` (one group at a time: ``cli`` adds the API's between
them), ``join``, ``demo``, ``plan``, ``invite`` and ``node``. ``cli`` makes the parsers, calls
these and parses argv."""

from __future__ import annotations

import argparse
from typing import Any

from seamline.cli_args import device_arg, precision_args, speculation_args, tensor_parallel_arg
from seamline.mesh.control.plan_args import add_plan_arguments

INVITE_ENV = "SEAMLINE_INVITE"  # where `join` may read its invite (argv shows in `ps`)


def at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction is in [0, 1], not {text}")
    return value


def log_format_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="json: one JSON object a line",
    )


def serve_host_args(serve: argparse.ArgumentParser) -> None:
    """The model, where this host listens, and what it contributes."""
    serve.add_argument(
        "--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2)"
    )
    log_format_arg(serve)
    device_arg(serve)
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


def serve_compute_args(serve: argparse.ArgumentParser) -> None:
    """How the model computes: precision, speculation, context."""
    precision_args(serve)
    speculation_args(serve)
    serve.add_argument("--context", type=int, default=0, help="context length (0: the model's own)")


def serve_mesh_args(serve: argparse.ArgumentParser) -> None:
    """The mesh: invites and state, a pinned plan, lockstep groups, and how long to wait."""
    serve.add_argument("--invite-hours", type=float, default=24.0)
    serve.add_argument(
        "--state-dir",
        default=None,
        help="the mesh CA, invites and admin key (default: <cache>/mesh; `seamline invite` reads it)",
    )
    serve.add_argument(
        "--lock", help="pin the plan in this JSON file (from `seamline plan --lock`)"
    )
    tensor_parallel_arg(
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


def serve_request_args(serve: argparse.ArgumentParser) -> None:
    """What a request meets: a private route, verification, the KV cache it is admitted into."""
    serve.add_argument(
        "--private",
        action="store_true",
        help="keep the embedding, the head and sampling on this machine's own node (the route's two "
        "ends): members hold only layers between and see no token id, prompt or answer",
    )
    serve.add_argument(
        "--verify-fraction",
        type=fraction,
        default=0.0,
        help="follow this fraction of requests through the coordinator's own copy of the model, "
        "holding their tokens until they check out (0: only the start-up check)",
    )
    serve.add_argument(
        "--verify-node", default=None, help=argparse.SUPPRESS
    )  # tests: a followed request checks the stage this node serves in (by default one at random)
    serve.add_argument(
        "--kv-cache-memory",
        type=float,
        default=0.0,
        help="GiB of KV cache the first stage (or --single) admits requests into "
        "(0: 80%% of the memory free at start); a request that cannot fit is refused",
    )


def serve_pipeline_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--micro-batches",
        type=at_least_zero,
        default=0,
        help="micro-batches in flight in the pipeline (default and least: one per stage)",
    )


def join_args(join: argparse.ArgumentParser) -> None:
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
    log_format_arg(join)
    join.add_argument("--no-progress", action="store_true", help="no download progress bar")
    join.add_argument(
        "--reprobe-when-idle",
        action="store_true",
        help="take the stage's speed probe again once it is idle and its cores quiet (for predictions)",
    )
    device_arg(join)


def demo_args(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--nodes", type=int, default=2)
    demo.add_argument("--model", default=None)
    # a question the embedded model answers on a wide margin at every precision (its first token
    # for the capital of France is a near tie that int8 activations flip: README, Precision)
    demo.add_argument("-p", "--prompt", default="What is the capital of Japan?")
    demo.add_argument("--max-tokens", type=int, default=64)
    precision_args(demo)
    tensor_parallel_arg(demo, "N nodes per stage, in lockstep")


def plan_args(plan: argparse.ArgumentParser) -> None:
    add_plan_arguments(plan)
    tensor_parallel_arg(
        plan, "N nodes per stage in lockstep (0: groups only where no node holds a stage)"
    )


def admin_args(invite: argparse.ArgumentParser, node: argparse.ArgumentParser) -> None:
    """``invite create|list|revoke`` and ``node remove``, each told where the coordinator is."""
    actions: Any = invite.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="a new invite token")
    create.add_argument(
        "--uses", type=int, default=None, help="nodes it may admit (default: any number)"
    )
    create.add_argument("--expires", default="24h", help="lifetime: 90s, 30m, 1h, 7d (default 24h)")
    actions.add_parser("list", help="every invite, its uses and state")
    revoke = actions.add_parser("revoke", help="no node joins with it from now on")
    revoke.add_argument("id")
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
