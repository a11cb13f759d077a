"""A node that serves slower than it is planned is planned at the rate it served
(``Coordinator.serving_pace``).

A node is planned at no more than the rate it proved when it joined (``plan.measured``); under
load it may still serve slower (a machine busy with something else, or one that proved fast and
then computes slowly). A plan of single-node stages is re-balanced from its stages' measured
step times (``balance``), all but a private mesh's, whose ends are the coordinator's own node:
every ``WINDOW_S`` while a private plan serves, the coordinator reads each stage's decode
counters (steps run, their seconds). Over ``SUSTAINED_S`` in which every stage ran ``MIN_STEPS`` steps, a node's seconds per step over
the plan's prediction for it is its slowdown, taken relative to the least slowed node: the rows
of a step and the load on the machines slow every stage alike, so only a node slower than its
fellows is slower than its plan. A node slowed ``CLEAR`` times or more is planned from then on at
its planned rate over its slowdown (a rate that only ever goes down), and the mesh switches to
the plan the lowered rates give when it gives such a node fewer layers. Windows too light to
tell are skipped and a switch starts a fresh window; ``MAX_REPLANS`` switches per set of members
at most, so a load that keeps changing is not chased.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seamline.mesh.plan.measured import planned_rate
from seamline.mesh.plan.types import Plan
from seamline.net.messages import Stats

if TYPE_CHECKING:
    from seamline.mesh.control.coordinator import Coordinator

log = logging.getLogger("seamline.coordinator")
WINDOW_S = 10.0  # between readings (``balance`` reads the stages too)
SUSTAINED_S = 30.0  # a node is judged over this much serving, never over a burst
MIN_STEPS = 50  # decode steps each stage must run in the window
CLEAR = 1.5  # slower than its plan by this much (against its fellow stages) to be re-planned
MAX_REPLANS = 2  # per set of members


@dataclass(frozen=True)
class DecodeCounters:
    plan_id: int
    at_s: float  # monotonic seconds when read
    steps: dict[str, int]  # per node: decode steps so far
    seconds: dict[str, float]  # per node: their seconds so far


def slowdowns(plan: Plan, before: DecodeCounters, after: DecodeCounters) -> dict[str, float] | None:
    """Per node of ``plan``: its seconds per decode step over the plan's prediction, relative to
    the least slowed node; None when the window spans a change of plan, is shorter than
    ``SUSTAINED_S``, or a stage ran fewer than ``MIN_STEPS`` steps in it."""
    if before.plan_id != after.plan_id or after.at_s - before.at_s < SUSTAINED_S:
        return None
    predicted: dict[str, float] = {}
    for stage in plan.stages:  # a private mesh's own node holds two stages: their sum
        predicted[stage.node_id] = predicted.get(stage.node_id, 0.0) + stage.compute_s
    ratios = {}
    for node, planned_s in predicted.items():
        steps = after.steps.get(node, 0) - before.steps.get(node, 0)
        spent = after.seconds.get(node, 0.0) - before.seconds.get(node, 0.0)
        if steps < MIN_STEPS or spent <= 0 or planned_s <= 0:
            return None
        ratios[node] = spent / steps / planned_s
    least = min(ratios.values())
    return {node: ratio / least for node, ratio in ratios.items()}


def clearly_slow(found: dict[str, float]) -> dict[str, float]:
    return {node: slowdown for node, slowdown in found.items() if slowdown >= CLEAR}


class ServingPace:
    """The coordinator's watch over each stage's pace against its plan."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self._start: DecodeCounters | None = None  # the window's first reading
        self._members: frozenset[str] = frozenset()
        self._replans = 0  # switches for these members
        self._stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="seamline-pace").start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(WINDOW_S):
            try:
                self.tick()
            except Exception:  # a failed look at the stages never stops the mesh serving
                log.debug("the pace watch could not read the stages", exc_info=True)

    def tick(self) -> None:
        """Read the stages; once a window is long and loaded enough, lower the rate of each
        node clearly slower than planned and re-plan."""
        c = self.coordinator
        plan, plan_id = c.plan, c.plan_id
        if plan is None or not c.ready.is_set() or len(plan.stages) < 2:
            self._start = None
            return
        if not plan.private or any(s.ranks for s in plan.stages):  # ``balance`` watches the rest
            self._start = None
            return
        members = frozenset(s.node_id for s in plan.stages)
        if members != self._members:
            self._members, self._replans = members, 0
        if self._replans >= MAX_REPLANS:
            return
        now = _counters(plan_id, c.stage_stats())
        if self._start is None or self._start.plan_id != plan_id:
            self._start = now
            return
        found = slowdowns(plan, self._start, now)
        if found is None:
            return
        self._start = now  # each window judged once
        slow = clearly_slow(found)
        if slow and self._lower(slow) and c.planning.replan_slow(plan, slow):
            self._replans += 1

    def _lower(self, slow: dict[str, float]) -> bool:
        """Plan each slow node at its planned rate over its slowdown; whether any was lowered."""
        lowered = False
        for node, slowdown in slow.items():
            handle = self.coordinator.nodes.get(node)
            if handle is None or node == self.coordinator.own_node():
                continue  # its core also runs the API and the clients: ``balance`` weighs that
            r = handle.join.resources
            rate = planned_rate(r.bytes_per_second, handle.proven_rate, handle.served_rate)
            handle.served_rate = rate / slowdown
            log.warning(
                "node %s served %.2fx slower than planned: planned at %.2f GB/s from now on",
                node,
                slowdown,
                handle.served_rate / 1e9,
            )
            lowered = True
        return lowered


def _counters(plan_id: int, stats: list[Stats]) -> DecodeCounters:
    return DecodeCounters(
        plan_id,
        time.monotonic(),
        {s.node_id: s.decode_steps for s in stats},
        {s.node_id: s.decode_seconds for s in stats},
    )
