"""What `seamline plan` prints from the simulator: a plan's predictions under load, and with
``--simulate`` a sweep over the pool (its first n nodes, n = 1..N) as a table and a plot.

A member with ``fails_at_s`` fails then in the simulated run: the mesh replans over the pool
without it (``plan_auto``, as the coordinator does) and replays the requests it was serving.
One failure per run: the first planned member to fail (others' ``fails_at_s`` are not simulated).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from seamline.config import ModelConfig
from seamline.mesh.plan.groups import plan_auto
from seamline.mesh.plan.types import LinkTable, ModelSpec, NodeInfo, Plan, PlanError, PlanOptions
from seamline.sim.prediction import predict_many

INSTALL_HINT = (
    "pip install 'seamline[sim]' gives the simulator's predictions under load (it needs simpy)"
)
PLOT_HINT = "pip install 'seamline[sim]' gives the plot (it needs matplotlib)"


@dataclass(frozen=True)
class SimOptions:
    """The load `seamline plan` predicts for: clients that start together, each one request."""

    clients: tuple[int, ...] = (1, 16, 64)
    prompt_tokens: int = 128
    output_tokens: int = 128
    simulate: bool = (
        False  # the sweep over the pool's first n nodes instead of one plan's predictions
    )
    plot: str = "seamline-simulate.png"


@dataclass(frozen=True)
class Scenario:
    """A pool to plan over as `seamline plan` does."""

    model: ModelSpec
    config: ModelConfig
    nodes: tuple[NodeInfo, ...]
    links: LinkTable
    options: PlanOptions
    tensor_parallel: int = 0

    def plan(self, nodes: Sequence[NodeInfo]) -> Plan:
        return plan_auto(
            self.model, nodes, self.links, self.options, self.config, self.tensor_parallel
        )


@dataclass(frozen=True)
class SweepRow:
    nodes: int
    clients: int
    prediction: dict[str, Any] | None  # ``predict``'s; None: no plan fits
    note: str = ""


def simulator_missing() -> str | None:
    """The install hint when the simulator cannot run here, else None."""
    return None if importlib.util.find_spec("simpy") else INSTALL_HINT


def failover(
    sc: Scenario, plan: Plan, nodes: Sequence[NodeInfo]
) -> tuple[NodeInfo | None, Plan | None]:
    """The first member of ``plan`` to fail (None: none has ``fails_at_s``), and the plan over
    ``nodes`` without it (None: none fits)."""
    members = {m for s in plan.stages for m in s.members()}
    failing = [n for n in nodes if n.fails_at_s is not None and n.node_id in members]
    if not failing:
        return None, None
    first = min(failing, key=lambda n: (n.fails_at_s, n.node_id))
    try:
        return first, sc.plan([n for n in nodes if n.node_id != first.node_id])
    except PlanError:
        return first, None


def one_failure(nodes: Sequence[NodeInfo], failed: NodeInfo | None) -> list[NodeInfo]:
    """``nodes`` with only ``failed`` keeping its ``fails_at_s``."""
    keep = failed.node_id if failed is not None else None
    return [
        n if n.node_id == keep or n.fails_at_s is None else replace(n, fails_at_s=None)
        for n in nodes
    ]


def _predict(
    sc: Scenario, plan: Plan, nodes: Sequence[NodeInfo], sim: SimOptions
) -> tuple[list[dict[str, Any]], str]:
    """``predict`` at each client count, and a note on the simulated failure ("" without one)."""
    failed, after = failover(sc, plan, nodes)
    pool = one_failure(
        nodes, failed if after is not None else None
    )  # no plan after it: no failure to simulate
    results = predict_many(
        plan,
        sc.model,
        pool,
        sc.links,
        sim.clients,
        sim.prompt_tokens,
        sim.output_tokens,
        after_failure=after,
    )
    if failed is None:
        return results, ""
    then = (
        f"replanned onto {' -> '.join(after.node_ids())}"
        if after is not None
        else "no plan fits the rest (simulated without the failure)"
    )
    return results, f"{failed.node_id} fails at {failed.fails_at_s:g} s: {then}"


def prediction_lines(sc: Scenario, plan: Plan, sim: SimOptions) -> list[str]:
    """A few lines after a plan's table: at each client count, the predicted tokens per second,
    ms between tokens, time to first token and each stage's busy fraction."""
    missing = simulator_missing()
    if missing or not sim.clients:
        return [missing] if missing else []
    results, failure = _predict(sc, plan, sc.nodes, sim)
    lines = [
        f"predicted under load (simulated; clients start together, {sim.prompt_tokens}-token prompts, "
        f"{sim.output_tokens} tokens each; one client alone {results[0]['single_ms_per_token']:.2f} ms/token):",
        f"{'clients':>9} {'tok/s':>9} {'ms between tokens':>17} {'TTFT s':>9}  busy per stage",
    ]
    for r in results:
        busy = ", ".join(f"{name} {b:.0%}" for name, b in zip(r["stages"], r["busy"]))
        replayed = f" ({r['replayed']} replayed)" if failure else ""
        lines.append(
            f"{r['clients']:>9} {r['tok_s']:>9.1f} {r['ms_between_tokens']:>17.2f} "
            f"{_seconds(r['ttft_s']):>9}  {busy}{replayed}"
        )
    lines.extend(_notes(sc.nodes, failure))
    return lines


def _notes(nodes: Sequence[NodeInfo], failure: str) -> list[str]:
    notes = [f"simulated failure: {failure}"] if failure else []
    if not any(
        n.batched_bytes_per_second or any(d.batched_bytes_per_second for d in n.devices)
        for n in nodes
    ):
        notes.append(
            "no batched_bytes_per_second in the pool: a step of many rows is priced at the one-row "
            "rate (pessimistic under load)"
        )
    return notes


def sweep(sc: Scenario, sim: SimOptions) -> list[SweepRow]:
    """For n = 1..N, the plan over the pool's first n nodes predicted at each client count."""
    rows = []
    for n in range(1, len(sc.nodes) + 1):
        pool = sc.nodes[:n]
        try:
            plan = sc.plan(pool)
        except PlanError:
            rows.append(SweepRow(n, 0, None, "no plan fits"))
            continue
        results, failure = _predict(sc, plan, pool, sim)
        rows.extend(SweepRow(n, r["clients"], r, failure) for r in results)
    return rows


def format_sweep(rows: Sequence[SweepRow]) -> str:
    """The sweep as a table: one row per node count and client count."""
    lines = [
        f"{'nodes':>5} {'clients':>7} {'tok/s':>9} {'ms between tokens':>17} {'TTFT s':>9}  {'bottleneck':<16} "
        f"{'replayed':>8}  note"
    ]
    for row in rows:
        r = row.prediction
        if r is None:
            lines.append(
                f"{row.nodes:>5} {'-':>7} {'-':>9} {'-':>17} {'-':>9}  {'-':<16} {'-':>8}  {row.note}"
            )
            continue
        lines.append(
            f"{row.nodes:>5} {row.clients:>7} {r['tok_s']:>9.1f} {r['ms_between_tokens']:>17.2f} "
            f"{_seconds(r['ttft_s']):>9}  {r['bottleneck']:<16} {r['replayed']:>8}  {row.note}".rstrip()
        )
    return "\n".join(lines)


def plot_sweep(rows: Sequence[SweepRow], path: str) -> None:
    """Two panels against the node count, one line per client count: tokens per second, and ms
    between tokens. Drawn on the Agg canvas: no display, no global pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    rate_ax, gap_ax = fig.subplots(1, 2)
    for clients in sorted({r.clients for r in rows if r.prediction is not None}):
        points = [
            (r.nodes, r.prediction)
            for r in rows
            if r.clients == clients and r.prediction is not None
        ]
        xs, label = [n for n, _ in points], f"{clients} client{'s' if clients > 1 else ''}"
        rate_ax.plot(xs, [p["tok_s"] for _, p in points], marker="o", label=label)
        gap_ax.plot(xs, [p["ms_between_tokens"] for _, p in points], marker="o", label=label)
    for ax, title in (
        (rate_ax, "tokens per second (all clients)"),
        (gap_ax, "ms between tokens (p50)"),
    ):
        ax.set_xlabel("nodes (the pool's first n)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)


def run_sweep(sc: Scenario, sim: SimOptions) -> str:
    """``--simulate``: the sweep's table, its plot written to ``sim.plot``."""
    missing = simulator_missing()
    if missing:
        return missing
    rows = sweep(sc, sim)
    text = [
        f"simulated: the pool's first n nodes, clients start together, {sim.prompt_tokens}-token prompts, "
        f"{sim.output_tokens} tokens each",
        format_sweep(rows),
    ]
    text.extend(_notes(sc.nodes, ""))
    if importlib.util.find_spec("matplotlib") is None:
        text.append(PLOT_HINT)
    elif any(r.prediction is not None for r in rows):
        plot_sweep(rows, sim.plot)
        text.append(f"plot written to {sim.plot}")
    return "\n".join(text)


def _seconds(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "-"
