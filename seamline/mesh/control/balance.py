"""Re-planning from what the stages measure (``Coordinator.balance``).

A plan prices each stage from its node's probed rate, but under load a stage can run slower
than that: its core also runs the coordinator's API and the clients, or a neighbour, and the
load's mix of prompt rows and decode rows weighs the stages otherwise than one row does. Every
``WINDOW_S`` while a plan of several single-node stages serves, the coordinator reads each
stage's busy seconds (its forwards' wall time) and its idle seconds (waiting with nothing to
run, ``runtime.idle_clock``). Over a window in which the busiest stage was busy at least
``MIN_BUSY`` of the time (the pipeline is loaded), a stage's occupied seconds (the window less
its idle seconds: its forwards, its own work between them, and the time it had work while its
core ran something else) over the plan's prediction for it is its slowdown, relative to the
stages' mean (the same rows pass through every stage). Every ``LOADED_WINDOWS`` loaded windows
(windows not loaded between them skipped), the plan's latest loaded windows, ``KEPT_WINDOWS`` at
most, are taken together; when the slowdowns over them part by more than ``TOLERANCE`` (15%),
each node is planned from then on at its rate (as the serving plan priced
it) over its slowdown across them to the power ``DAMPING``, and the mesh switches to the plan
those rates give if it is predicted ``GAIN`` times as fast as the current route at the same
rates. A node's correction that goes back the way the last switch moved it goes ``REVERSAL``
of the way (in logarithms): where the best cut lies between two plans that each read the other
way (stage 0 1.12x slow at 17 layers, 0.92x at 15, in one `bench scale` run: 17, 15, 17, 15),
the rates close in on the cut between rather than switching back and forth. A switch ends the
requests in flight as a live growth does: they replay on the new route; so a set of members
is re-balanced ``MAX_SWITCHES`` times at most (a load that keeps changing its character is not
chased), and again once the members change.
An administrator may hold the serving plan (``PUT /api/admin/balance``): no re-balance while held.

Why idle seconds, not other processes' CPU on a stage's core: the front's work on stage 0's core
slows the pipeline only while stage 0 has work; in the lull between two bursts of requests (the
next burst's arrivals, a client process starting) or while stage 0 waits for its tokens to come
back, it costs nothing. Read on a 1 GbE mesh under waves of 64 clients, counting the others' CPU
over the whole window read stage 0 1.4-2.8x slow over a lull (a window loaded in its other half
then decided with the rest and switched the mesh to a worse cut); the occupied seconds read the
same windows 0.9-1.3x. Why 24 s of load, and more once a plan has served: a window of prompts
and one of decode rows weigh the stages in opposite ways (a stage holding the head is slow only
while decoding, and slowest when few rows are left at the end of a burst); on that mesh single 6 s
windows at one cut parted 0.6-1.3, four together 0.79-1.08: a plan that read even over its first
eight windows was switched by four that came at the ends of bursts. Its latest windows up to 96 s
of load weigh such a four with the rest (0.94 there), and still follow a load that changes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seamline.net.messages import Stats

if TYPE_CHECKING:
    from seamline.mesh.control.coordinator import Coordinator
    from seamline.mesh.plan.types import Plan

log = logging.getLogger("seamline.coordinator")
WINDOW_S = 6.0
MIN_BUSY = (
    0.5  # of the window, on the busiest stage: below, the pipeline is not loaded enough to tell
)
LOADED_WINDOWS = 4  # a decision every so many loaded windows
KEPT_WINDOWS = 16  # a plan's latest loaded windows, taken together, decide
TOLERANCE = 0.15
GAIN = 1.05  # a re-balanced plan is switched to when predicted this much faster
DAMPING = 0.75  # of a measured slowdown, in logarithms, taken into a node's planned rate
MAX_SWITCHES = 3  # re-balances per set of members
REVERSAL = 0.5  # of a correction that undoes the last switch's, in logarithms
CORRECTION_BOUNDS = (
    0.25,
    4.0,
)  # a node is never planned at less than a quarter, or more than 4x, its probed rate


@dataclass(frozen=True)
class BusyWindow:
    plan_id: int
    at_s: float  # monotonic seconds when the counters were read
    busy: tuple[float, ...]  # each stage's forwards' seconds so far
    idle: tuple[float, ...]  # each stage's seconds waiting with nothing to run so far


def slowdowns(plan: Plan, before: BusyWindow, after: BusyWindow) -> dict[str, float] | None:
    """Each stage's node: its measured occupied seconds over the predicted, relative to the
    stages' mean; None when the pipeline was not loaded or the window spans a change of plan."""
    wall = after.at_s - before.at_s
    if before.plan_id != after.plan_id or len(before.busy) != len(plan.stages) or wall <= 0:
        return None
    spent = [b1 - b0 for b0, b1 in zip(before.busy, after.busy)]
    if (
        max(spent) < MIN_BUSY * wall
        or min(spent) <= 0
        or any(s.under_load_s <= 0 for s in plan.stages)
    ):
        return None
    idle = [i1 - i0 for i0, i1 in zip(before.idle, after.idle)]
    occupied = [
        max(busy, wall - waited) for busy, waited in zip(spent, idle)
    ]  # at least its forwards
    ratios = {
        stage.node_id: seconds / stage.under_load_s for stage, seconds in zip(plan.stages, occupied)
    }
    mean = sum(ratios.values()) / len(ratios)
    return {node: ratio / mean for node, ratio in ratios.items()}


def parted(found: dict[str, float]) -> bool:
    return max(found.values()) > min(found.values()) * (1 + TOLERANCE)


class Balance:
    """The coordinator's watch over its stages' measured speed; ``corrections`` scales each
    node's planned rate (``Planning.candidate`` reads it)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.corrections: dict[str, float] = {}
        self._basis: dict[str, float] = {}  # the corrections the serving plan was priced with
        self._plan_id = -1
        self._members: frozenset[str] = frozenset()
        self._switches = 0  # re-balances of these members
        self._moved: dict[
            str, float
        ] = {}  # the last switch's change to each node's correction (logarithm)
        self._last: BusyWindow | None = None
        self._loaded: list[
            tuple[BusyWindow, BusyWindow]
        ] = []  # the serving plan's latest loaded windows
        self._fresh = 0  # of them, loaded since the last decision
        self._kept = -1  # the last plan a decision kept
        self._stopped = threading.Event()
        self.held = False  # an administrator's: the serving plan stays, whatever the stages measure

    def start(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="seamline-balance").start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(WINDOW_S):
            try:
                self.tick()
            except Exception:  # a failed look at the stages never stops the mesh serving
                log.debug("the balance watch could not read the stages", exc_info=True)

    def tick(self) -> None:
        """Read the stages; every ``LOADED_WINDOWS`` loaded windows, re-plan if the plan's latest found them parted."""
        c = self.coordinator
        plan, plan_id = c.plan, c.plan_id
        if plan is None or not c.ready.is_set() or not _balanced(plan) or self.held:
            self._last = None
            return
        if plan_id != self._plan_id:  # a new plan: priced with the corrections as they are now
            self._plan_id, self._basis, self._loaded, self._fresh = (
                plan_id,
                dict(self.corrections),
                [],
                0,
            )
            members = frozenset(s.node_id for s in plan.stages)
            if members != self._members:
                self._members, self._switches, self._moved = members, 0, {}
        if self._switches >= MAX_SWITCHES:
            self._last = None
            return
        window = _window(plan_id, c.stage_stats())
        before, self._last = self._last, window
        if before is None or slowdowns(plan, before, window) is None:
            return  # not loaded: skipped
        self._loaded, self._fresh = (
            [*self._loaded[1 - KEPT_WINDOWS :], (before, window)],
            self._fresh + 1,
        )
        if self._fresh < LOADED_WINDOWS:
            return
        self._fresh = 0
        together = slowdowns(plan, *_joined(self._loaded))
        if together is None or not parted(together) or not self.rebalance(plan, together):
            self._kept = plan_id

    def rebalance(self, plan: Plan, found: dict[str, float]) -> bool:
        """Plan each node at its corrected rate; whether the mesh switched to a new plan."""
        low, high = CORRECTION_BOUNDS
        moves = {}
        for node, slowdown in found.items():
            move = -DAMPING * math.log(slowdown)
            if move * self._moved.get(node, 0.0) < 0:  # back the way the last switch went
                move *= REVERSAL
            moves[node] = move
            self.corrections[node] = min(
                high, max(low, self._basis.get(node, 1.0) * math.exp(move))
            )
        if not self.coordinator.planning.rebalance(plan, found, GAIN):
            return False
        self._switches += 1
        self._moved = moves
        return True

    def settled(self) -> bool:
        """Whether the serving plan stands: a decision over its loaded windows kept it, or none
        will come (a plan that is not re-balanced, a held one, or its members' switches spent)."""
        plan = self.coordinator.plan
        if plan is None or not _balanced(plan) or self.held or self._switches >= MAX_SWITCHES:
            return True
        return self._kept == self.coordinator.plan_id


def _balanced(plan: Plan) -> bool:
    """Whether a re-balance watches ``plan``: several single-node stages, not a private mesh's."""
    return len(plan.stages) >= 2 and not plan.private and not any(s.ranks for s in plan.stages)


def _joined(windows: list[tuple[BusyWindow, BusyWindow]]) -> tuple[BusyWindow, BusyWindow]:
    """Windows apart in time as one: their counters' growths added up, from zero."""
    plan_id, stages = windows[0][0].plan_id, len(windows[0][0].busy)
    busy = tuple(sum(w1.busy[i] - w0.busy[i] for w0, w1 in windows) for i in range(stages))
    idle = tuple(sum(w1.idle[i] - w0.idle[i] for w0, w1 in windows) for i in range(stages))
    start = BusyWindow(plan_id, 0.0, (0.0,) * stages, (0.0,) * stages)
    return start, BusyWindow(plan_id, sum(w1.at_s - w0.at_s for w0, w1 in windows), busy, idle)


def _window(plan_id: int, stats: list[Stats]) -> BusyWindow:
    return BusyWindow(
        plan_id,
        time.monotonic(),
        tuple(s.busy_seconds for s in stats),
        tuple(s.idle_seconds for s in stats),
    )
