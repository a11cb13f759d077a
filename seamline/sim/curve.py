"""The scale curve: simulated tokens per second of DeepSeek-V3 (671B, Q4_K_M) and DeepSeek-V4-Flash
(as released, fp4 experts) on 2 to 200 identical nodes, over 1 GbE and over a 20 ms WAN, for one
client and for 64 clients starting together.

Every node is a DGX Spark (``reference.DGX_SPARK``: 128 GiB of unified memory at 273 GB/s, planned
as one memory pool): its ``NodeInfo`` has the whole 128 GiB free and the speeds of
``reference.device_speed`` at the model's active bytes per parameter (the one-row rate and the
batched rates at 16 and 64 rows). Each pool is planned by ``plan_auto`` as `seamline plan` plans it
(KV cache for the 64-client load: 64 sequences of prompt + output tokens), turned into a route by
``route_of`` and run by ``simulate``. A pipeline has at most one stage per layer (V3: 61, V4-Flash:
43); the nodes the plan leaves out stand by, and the table says how many stages it used.

One correction to ``route_of``: it prices a Mixture-of-Experts stage at its active bytes at every
row count, but a step of r rows reads every routed expert at least one row picks, which at 16-64
rows is most of them. The curve gives each stage its routed experts (``StageCost.expert_bytes``,
per rank in a lockstep group) so that a batched step reads their union.

Pools whose plans are alike (same layer ranges and group sizes: the nodes and links are uniform)
are simulated once. ``bound_tok_s`` beside each point is the closed-form steady state
(``simulate.pipeline_bound_tok_s``, decode only, ceil(clients / stages) rows per micro-batch).

``python -m seamline.sim.curve --plot PATH --json PATH`` writes the plot and every point and prints
a markdown table. Pure Python, no torch; needs simpy (and matplotlib for the plot).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from seamline.config import ModelConfig
from seamline.mesh.plan.groups import plan_auto
from seamline.mesh.plan.types import (
    LinkCost,
    LinkTable,
    ModelSpec,
    NodeInfo,
    Plan,
    PlanError,
    PlanOptions,
)
from seamline.sim import published as ref
from seamline.sim.costs import Load
from seamline.sim.prediction import route_of

if TYPE_CHECKING:  # the simulator needs simpy: imported where it runs
    from seamline.sim.simulate import Pipeline

NODE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 100, 128, 200)
CLIENTS = (1, 64)
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 128
LINKS: dict[str, LinkCost] = {"1 GbE": ref.LINK_1GBE, "20 ms WAN": ref.LINK_WAN_20MS}
HARDWARE = ref.DGX_SPARK
MODELS: dict[str, Callable[[], ref.Checkpoint]] = {
    "DeepSeek-V3 671B Q4_K_M": ref.v3_q4_k_m_checkpoint,
    "DeepSeek-V4-Flash": ref.v4_flash_checkpoint,
}


@dataclass(frozen=True)
class Point:
    """One simulated wave: a model on ``nodes`` Sparks over ``link`` with ``clients`` clients."""

    model: str
    nodes: int
    link: str
    clients: int
    stages: int = 0  # pipeline stages the plan uses (0: no plan fits)
    nodes_used: int = 0  # the rest stand by
    group: int = 1  # nodes per stage (>1: lockstep groups)
    layers: tuple[int, ...] = ()  # layers of each stage
    tok_s: float = math.nan  # every client's tokens / the wave's wall time (prefill included)
    ms_between_tokens: float = math.nan  # p50
    ttft_s: float = math.nan  # p50
    wall_s: float = math.nan
    bound_tok_s: float = math.nan  # closed-form steady-state decode
    busiest: float = math.nan  # the busiest stage's busy share
    sim_s: float = 0.0  # seconds the simulation took here (0: reused from an alike plan)
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.stages > 0


@dataclass(frozen=True)
class _ModelCase:
    name: str
    checkpoint: ref.Checkpoint
    spec: ModelSpec
    pool_of: Callable[[int], list[NodeInfo]]


def spark_pool(count: int, bytes_per_param: float, hw: ref.Hardware = HARDWARE) -> list[NodeInfo]:
    """``count`` identical nodes of ``hw``: all its memory free, its published speeds at
    ``bytes_per_param`` (the CPU entry of NodeInfo: unified memory has no separate GPU pool)."""
    speed = ref.device_speed(hw, bytes_per_param)
    batched = tuple(sorted((int(r), float(v)) for r, v in speed.batched.items()))
    return [
        NodeInfo(
            f"spark-{i:03d}",
            hw.memory_bytes,
            speed.bytes_per_second,
            batched_bytes_per_second=batched,
        )
        for i in range(count)
    ]


def with_routed_experts(
    route: Pipeline, plan: Plan, spec: ModelSpec, config: ModelConfig
) -> Pipeline:
    """``route`` with each stage's routed experts named, so that a step of r rows reads the
    experts its rows pick (their union) rather than the one-row share (module doc)."""
    if not config.num_experts:
        return route
    share = config.num_experts_per_tok / config.num_experts
    held, active = spec.layer_bytes, spec.active_bytes()
    stages = []
    for cost, stage in zip(route.stages, plan.stages):
        # held - active over a range is its routed experts' bytes times (1 - k/E); a rank holds 1/N of them
        experts = sum(
            h - a for h, a in zip(held[stage.start : stage.end], active[stage.start : stage.end])
        )
        per_rank = experts / (1.0 - share) / len(stage.members())
        stages.append(
            replace(
                cost,
                expert_bytes=per_rank,
                experts=config.num_experts,
                experts_per_token=config.num_experts_per_tok,
            )
        )
    return replace(route, stages=tuple(stages))


def load_model(name: str) -> _ModelCase:
    """A published model of MODELS, its spec and its pool of Sparks."""
    checkpoint = MODELS[name]()
    spec = checkpoint.spec()
    per_param = ref.active_bytes_per_param(checkpoint, spec)
    return _ModelCase(name, checkpoint, spec, lambda count: spark_pool(count, per_param))


def plan_options(clients: Sequence[int], load: Load) -> PlanOptions:
    """KV cache for the largest wave: every client's prompt and output tokens."""
    return PlanOptions(context_tokens=load.prompt_tokens + load.output_tokens, batch=max(clients))


def _simulated(
    model: _ModelCase, plan: Plan, pool: list[NodeInfo], link: LinkCost, clients: int, load: Load
) -> dict[str, Any]:
    """``simulate`` over the plan's route (routed experts counted): the point's measured fields."""
    from seamline.sim.simulate import pipeline_bound_tok_s, simulate

    route = with_routed_experts(
        route_of(plan, model.spec, pool, LinkTable(default=link)),
        plan,
        model.spec,
        model.checkpoint.config,
    )
    started = time.perf_counter()
    result = simulate(route, Load(clients, load.prompt_tokens, load.output_tokens))
    rows = -(-clients // route.batches())
    return {
        "tok_s": result.tok_s,
        "ms_between_tokens": result.p50_ms_between_tokens(),
        "ttft_s": result.p50_ttft_s(),
        "wall_s": result.wall_s,
        "busiest": max(result.busy),
        "bound_tok_s": pipeline_bound_tok_s(route, rows),
        "sim_s": time.perf_counter() - started,
    }


def model_points(
    model: _ModelCase,
    counts: Sequence[int],
    links: dict[str, LinkCost],
    clients: Sequence[int],
    load: Load,
) -> list[Point]:
    """Every (nodes, link, clients) point of one model; alike plans are simulated once."""
    options = plan_options(clients, load)
    done: dict[
        tuple[Any, ...], tuple[int, dict[str, Any]]
    ] = {}  # alike plan -> (first count, fields)
    points = []
    for count in counts:
        pool = model.pool_of(count)
        for label, link in links.items():
            try:
                plan = plan_auto(
                    model.spec, pool, LinkTable(default=link), options, model.checkpoint.config
                )
            except PlanError:
                points.extend(
                    Point(model.name, count, label, c, note="does not fit") for c in clients
                )
                continue
            group = max(len(s.members()) for s in plan.stages)
            shape = {
                "stages": len(plan.stages),
                "nodes_used": sum(len(s.members()) for s in plan.stages),
                "group": group,
                "layers": tuple(s.end - s.start for s in plan.stages),
            }
            for c in clients:
                key = (label, c, plan.ranges(), tuple(len(s.members()) for s in plan.stages))
                note = ""
                if key in done:
                    first, fields = done[key]
                    fields, note = {**fields, "sim_s": 0.0}, f"same plan as {first} nodes"
                else:
                    fields = _simulated(model, plan, pool, link, c, load)
                    done[key] = (count, fields)
                points.append(Point(model.name, count, label, c, note=note, **shape, **fields))
    return points


def curve(
    models: Sequence[str] = tuple(MODELS),
    counts: Sequence[int] = NODE_COUNTS,
    links: dict[str, LinkCost] | None = None,
    clients: Sequence[int] = CLIENTS,
    load: Load = Load(max(CLIENTS), PROMPT_TOKENS, OUTPUT_TOKENS),
) -> list[Point]:
    """Every point of the curve (``load.clients`` is not read: ``clients`` gives the waves)."""
    points = []
    for name in models:
        points.extend(model_points(load_model(name), counts, links or LINKS, clients, load))
    return points


def assumptions(load: Load, clients: Sequence[int]) -> list[str]:
    """The curve's assumptions, one line each."""
    hw = HARDWARE
    return [
        f"node: {hw.name}, {hw.memory_bytes / ref.GiB:.0f} GiB unified memory at {hw.bandwidth_bytes_per_s / 1e9:.0f} "
        f"GB/s (read at {ref.BANDWIDTH_EFFICIENCY:.0%}), {hw.flops / 1e12:.1f} TFLOPS BF16 (batched rows at "
        f"{ref.COMPUTE_EFFICIENCY:.0%}); every node alike",
        "models: DeepSeek-V3 671B in llama.cpp's Q4_K_M mix; DeepSeek-V4-Flash as released (fp4 routed experts, "
        "fp8 projections), held with float32 scales",
        f"load: {' or '.join(map(str, clients))} clients starting together, each one request of "
        f"{load.prompt_tokens} prompt tokens and {load.output_tokens} output tokens; tok/s = every client's output "
        "tokens / the wave's wall time (prefill included)",
        f"links: every pair alike: 1 GbE ({ref.LINK_1GBE.latency_s * 1e3:g} ms one way, "
        f"{ref.LINK_1GBE.bandwidth_bytes_per_s / 1e6:.1f} MB/s) or a 20 ms WAN (20 ms one way, "
        f"{ref.LINK_WAN_20MS.bandwidth_bytes_per_s / 1e6:.1f} MB/s)",
        f"plan: plan_auto, throughput objective, KV cache for {max(clients)} sequences of "
        f"{load.prompt_tokens + load.output_tokens} tokens; one micro-batch per stage",
        "routed experts: a step of r rows reads the union of the experts its rows pick (route_of alone reads "
        "the one-row share at every row count)",
        "scheduler: at most 512 tokens a step, prompt chunks of 512; no front (API) cost, no speculative decoding",
    ]


def _cell(point: Point | None) -> str:
    if point is None or not point.fits:
        return "does not fit"
    return f"{point.tok_s:.1f}"


def markdown(points: Sequence[Point], links: Sequence[str], clients: Sequence[int]) -> str:
    """The curve as a markdown table: a row per model and node count, a column per (link, clients)."""
    columns = [(label, c) for label in links for c in clients]
    head = ["model", "nodes", "stages used (standing by)"] + [
        f"{label}, {c} client{'s' if c > 1 else ''} tok/s" for label, c in columns
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_key = {(p.model, p.nodes, p.link, p.clients): p for p in points}
    for model, nodes in dict.fromkeys((p.model, p.nodes) for p in points):
        row = [by_key.get((model, nodes, label, c)) for label, c in columns]
        shapes = dict.fromkeys(
            f"{p.stages} ({p.nodes - p.nodes_used})"
            + (f", groups of {p.group}" if p.group > 1 else "")
            for p in row
            if p is not None and p.fits
        )
        stages = " / ".join(shapes) if shapes else "-"
        lines.append(
            "| " + " | ".join([model, str(nodes), stages] + [_cell(p) for p in row]) + " |"
        )
    return "\n".join(lines)


def plot(points: Sequence[Point], path: str) -> None:
    """Two panels (a model each): tok/s against the node count on log axes, a line per (link, clients)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(p.model for p in points))
    fig = Figure(figsize=(6 * len(models), 4.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    series = list(dict.fromkeys((p.link, p.clients) for p in points))
    for ax, model in zip(axes, models):
        for link, clients in series:
            xs = [
                (p.nodes, p.tok_s)
                for p in points
                if (p.model, p.link, p.clients) == (model, link, clients) and p.fits
            ]
            if xs:
                style = "-" if link == next(iter(LINKS)) else "--"
                ax.plot(
                    *zip(*xs), style, marker="o", markersize=3, label=f"{link}, {clients} client(s)"
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{model} on {HARDWARE.name} nodes")
        ax.set_xlabel("nodes")
        ax.set_ylabel("tokens per second (all clients)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)


def _jsonable(value: Any) -> Any:
    """NaN as null, tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def to_json(points: Sequence[Point], load: Load, clients: Sequence[int], elapsed_s: float) -> str:
    data = {
        "assumptions": assumptions(load, clients),
        "node_counts": sorted({p.nodes for p in points}),
        "elapsed_s": round(elapsed_s, 1),
        "points": [asdict(p) for p in points],
    }
    return json.dumps(_jsonable(data), indent=1) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m seamline.sim.curve", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--plot", help="write the plot (PNG) here")
    parser.add_argument("--json", help="write every point (JSON) here")
    parser.add_argument(
        "--counts", type=int, nargs="+", default=list(NODE_COUNTS), help="node counts"
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    args = parser.parse_args(argv)
    load = Load(max(CLIENTS), PROMPT_TOKENS, args.output_tokens)
    started = time.perf_counter()
    points = curve(args.models, args.counts, LINKS, CLIENTS, load)
    elapsed = time.perf_counter() - started
    print(markdown(points, list(LINKS), CLIENTS))
    print("\n" + "\n".join(f"- {line}" for line in assumptions(load, CLIENTS)))
    print(f"\n{len(points)} points in {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(to_json(points, load, CLIENTS, elapsed))
    if args.plot:
        plot(points, args.plot)


if __name__ == "__main__":
    main()
