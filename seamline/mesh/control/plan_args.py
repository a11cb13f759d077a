"""The arguments of `seamline plan` (apart from ``plan_cli``, whose imports are too heavy to
build the command line's parser with)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seamline.sim.report import SimOptions

MAX_CLIENTS = 4096


def client_counts(text: str) -> tuple[int, ...]:
    """``--clients 1,16,64``: client counts, each from 1 to ``MAX_CLIENTS``."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--clients takes counts separated by commas, such as 1,16,64, not {text!r}"
        ) from None
    if not counts or not all(1 <= c <= MAX_CLIENTS for c in counts):
        raise argparse.ArgumentTypeError(
            f"--clients takes counts from 1 to {MAX_CLIENTS}, not {text!r}"
        )
    return counts


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a token count is an integer >= 1, not {text!r}")
    return value


def add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    """The pool, the model and the planner's options; then the load the simulator predicts for."""
    plan.add_argument("--nodes", dest="nodes_json", help="JSON list of nodes")
    plan.add_argument("--live", help="URL of a running coordinator (http://host:port)")
    plan.add_argument("--model", default=None)
    plan.add_argument("--lock", default=None, help="write (or check) the plan in this file")
    plan.add_argument("--context", type=int, default=4096)
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument(
        "--objective",
        choices=("throughput", "latency"),
        default="throughput",
        help="throughput under load (the slowest stage; the default) or per-token latency",
    )
    plan.add_argument(
        "--clients",
        type=client_counts,
        default=(1, 16, 64),
        metavar="N,N,...",
        help="client counts the simulator predicts for (default 1,16,64)",
    )
    plan.add_argument(
        "--prompt-tokens", type=_positive, default=128, help="each client's prompt (default 128)"
    )
    plan.add_argument(
        "--output-tokens", type=_positive, default=128, help="tokens each client gets (default 128)"
    )
    plan.add_argument(
        "--simulate",
        action="store_true",
        help="simulate the pool's first n nodes for n = 1..N at each client count: a table and a plot",
    )
    plan.add_argument(
        "--plot",
        default="seamline-simulate.png",
        metavar="PATH",
        help="where --simulate writes its plot (default seamline-simulate.png)",
    )


def plan_sim_options(args: argparse.Namespace) -> SimOptions:
    """The simulator's ``SimOptions`` from the parsed arguments."""
    from seamline.sim.report import SimOptions

    return SimOptions(
        tuple(args.clients), args.prompt_tokens, args.output_tokens, args.simulate, args.plot
    )
