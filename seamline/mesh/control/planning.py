"""When the coordinator plans, and over whom (``Coordinator.planning``).

Nodes are planned at their measured rates times the share of their CPUs they have to
themselves (``plan.cores``). The first plan waits for ``nodes_expected`` checked members. A
restarted coordinator's first plan is the stages its rejoined nodes still hold, when they
cover the model and fit, unless a plan that takes in other nodes too would be ``GROWTH_GAIN``
times faster: the rates are measured again, noisily, and must not cost a reload. After that the mesh plans again
whenever a planned node is lost (over the rest, standbys included), when a failed start-up's
pause is over, when a node joins a serving mesh and a plan with it would be at least
``GROWTH_GAIN`` times faster (live growth), and when the stages' measured step times part from
the plan's (``balance``). A switch of route ends every request in flight on
the old one as "lost", and the backend replays it on the new one.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from seamline.mesh.control.mesh_state import (
    Growing,
    NoMembers,
    NoPlan,
    PlanChosen,
    Rebalancing,
    StartupFailed,
)
from seamline.mesh.plan.cores import core_shares
from seamline.mesh.plan.cuts import least_bottleneck_cuts
from seamline.mesh.plan.groups import plan_auto
from seamline.mesh.plan.measured import steady_rates
from seamline.mesh.plan.planner import check_plan
from seamline.mesh.plan.planner import plan as make_plan
from seamline.mesh.plan.pricing import price_route
from seamline.mesh.plan.private import plan_private
from seamline.mesh.plan.types import LinkTable, NodeInfo, Plan, PlanError, PlanOptions
from seamline.mesh.protocol.link_probe import Reach, link_table
from seamline.precision import once

if TYPE_CHECKING:
    from seamline.mesh.control.coordinator import Coordinator
    from seamline.mesh.control.node_handle import NodeHandle

log = logging.getLogger("seamline.coordinator")
GROWTH_GAIN = (
    1.10  # a joining node is planned in when the plan with it is predicted this much faster
)


class Planning:
    """The coordinator's planning over its members: it reads the mesh's state and changes it
    only through the coordinator's events."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.options = coordinator.options

    def maybe_plan(self, force: bool = False) -> None:
        """Plan over the checked members: the first time once ``nodes_expected`` have joined; then
        whenever no plan serves (``force``: a planned node left), or to take a new node in."""
        c = self.coordinator
        with c.lock:
            state = c.keeper.current
            joined = [h for h in state.nodes.values() if h.checked]
            if state.plan_id == 0 and len(joined) < self.options.nodes_expected:
                return
            if state.plan is not None and not force:
                self._maybe_grow(joined)
                return
            if not joined:
                c.apply(NoMembers())
                return
            try:
                chosen = self._after_back_off(joined)
            except PlanError as exc:
                c.apply(NoPlan(f"cannot plan: {exc}; waiting for a node to join"))
                return
            self._switch_to(chosen)

    def candidate(self, joined: list[NodeHandle]) -> Plan:
        """The plan over ``joined`` (PlanError when they cannot hold the model)."""
        joined = self._able(joined)
        nodes, links = self._pool(joined)
        fresh = self._choose_plan(nodes, links)
        held = self._held_plan(joined, nodes, links) if self.coordinator.plan_id == 0 else None
        if held is None or (
            members(fresh) - members(held) and pace(held) > pace(fresh) * GROWTH_GAIN
        ):
            return fresh
        log.info(
            "the rejoined nodes keep the stages they hold (a fresh plan would be %.2fx as fast)",
            pace(held) / pace(fresh),
        )
        return held

    def _after_back_off(self, joined: list[NodeHandle]) -> Plan:
        """The plan over the members not waiting out a back-off (``back_off``); over them all
        when the others alone cannot hold the model."""
        ready = self.coordinator.back_off.ready(joined)
        if ready and len(ready) < len(joined):
            try:
                return self.candidate(ready)
            except PlanError as exc:
                log.warning("planned members still backing off: the others cannot serve (%s)", exc)
        return self.candidate(joined)

    def _pool(self, joined: list[NodeHandle]) -> tuple[list[NodeInfo], LinkTable]:
        """The members as the planner sees them: probed rates times their core shares, like
        rates evened out, then scaled by what their stages measured under load (``balance``)."""
        shares = core_shares(h.placement() for h in joined)
        nodes = sorted((h.info(shares[h.node_id]) for h in joined), key=lambda n: n.node_id)
        links = link_table(
            (Reach(h.node_id, h.inbound, h.measured) for h in joined),
            self.coordinator.peer_links.measured(),
        )
        corrections = self.coordinator.balance.corrections
        nodes = [
            replace(n, bytes_per_second=n.bytes_per_second * corrections.get(n.node_id, 1.0))
            for n in steady_rates(nodes)
        ]  # like nodes measured apart plan alike
        return nodes, links

    def rebalance(self, current: Plan, found: dict[str, float], needed: float) -> bool:
        """The stages measured apart (``balance``): switch to the plan the corrected rates give
        when it is predicted ``needed`` times as fast as the current route at those rates; whether it
        switched."""
        c = self.coordinator
        with c.lock:
            if c.plan is not current or not c.ready.is_set():
                return False
            joined = self._able([h for h in c.keeper.current.nodes.values() if h.checked])
            try:
                nodes, links = self._pool(joined)
                order = [s.node_id for s in current.stages]
                moved = least_bottleneck_cuts(
                    c.model, {n.node_id: n for n in nodes}, self._plan_options(), order
                )
                if moved is None:
                    return False
                proposed = price_route(
                    c.model, nodes, links, current_options(current, self._plan_options()), moved
                )
                route = [(s.node_id, s.start, s.end) for s in current.stages]
                repriced = price_route(
                    c.model, nodes, links, current_options(current, self._plan_options()), route
                )
            except (PlanError, KeyError):
                return False
            gain = pace(repriced) / pace(proposed)
            slowdowns = ", ".join(f"{node} {value:.2f}x" for node, value in sorted(found.items()))
            if gain < needed or proposed.stages == repriced.stages:
                log.info(
                    "the stages measured apart (%s); a re-balanced plan would be %.2fx as fast: kept",
                    slowdowns,
                    gain,
                )
                return False
            c.apply(Rebalancing(slowdowns, gain))
            c.on_failure(None, "the mesh re-balanced its stages", "replanned")
            self._switch_to(proposed)
            return True

    def replan_slow(self, current: Plan, slow: dict[str, float]) -> bool:
        """Nodes served clearly slower than planned (``serving_pace``, which lowered their rates):
        switch to the plan over the members at their rates now when it gives a slow node fewer
        layers; whether it switched."""
        c = self.coordinator
        with c.lock:
            if c.plan is not current or not c.ready.is_set():
                return False
            try:
                proposed = self.candidate([h for h in c.keeper.current.nodes.values() if h.checked])
            except PlanError:
                return False
            if not any(layers_of(proposed, n) < layers_of(current, n) for n in slow):
                return False
            slowdowns = ", ".join(f"{node} {value:.2f}x" for node, value in sorted(slow.items()))
            c.apply(Rebalancing(slowdowns, pace(current) / pace(proposed)))
            c.on_failure(None, "the mesh re-planned around a node slower than planned", "replanned")
            self._switch_to(proposed)
            return True

    def _able(self, joined: list[NodeHandle]) -> list[NodeHandle]:
        """The members that can compute in the mesh's precision; each one that cannot is said once."""
        if not self.options.int8_activations:
            return joined
        unable = [h for h in joined if not h.join.resources.int8_kernels]
        for handle in unable:
            once(
                f"int8-{handle.node_id}",
                f"node {handle.node_id} cannot run the int8-block matmuls of precision "
                f"{self.options.precision} (no AVX-512 VNNI): it is not planned",
            )
        if len(unable) == len(joined):
            raise PlanError(
                f"no member can run precision {self.options.precision}: serve --precision exact"
            )
        return [h for h in joined if h.join.resources.int8_kernels]

    def _held_plan(
        self, joined: list[NodeHandle], nodes: list[NodeInfo], links: LinkTable
    ) -> Plan | None:
        """The plan of the stages rejoined nodes still hold, when they are this model's, cover it
        and fit (a restarted coordinator takes its mesh back without loading anything again)."""
        if self.options.locked_plan is not None:
            return None
        c = self.coordinator
        same = (
            c.model_hash,
            self.options.dtype,
            self.options.context_length,
            self.options.int8_activations,
        )
        held = [(h.node_id, h.join.holding) for h in joined if h.join.holding is not None]
        route = sorted(
            (
                (node, *x.layers)
                for node, x in held
                if (x.model_hash, x.dtype, x.context_length, x.int8_activations) == same
            ),
            key=lambda r: r[1],
        )
        flags = {node: (x.owns_embedding, x.owns_head) for node, x in held}
        if not route or any(flags[n] != (s == 0, e == c.model.num_layers) for n, s, e in route):
            return None
        try:
            plan = price_route(c.model, nodes, links, self._plan_options(), route)
            check_plan(plan, c.model, nodes, self._plan_options())
        except PlanError:
            return None
        return plan

    def _maybe_grow(self, joined: list[NodeHandle]) -> None:
        """A node joined a serving mesh: switch to the plan with it when it is fast enough more."""
        c = self.coordinator
        current = c.plan
        if not self.options.live_growth or current is None or not c.ready.is_set():
            return
        joined = c.back_off.ready(joined)  # a member that failed waits before it is taken in
        if {h.node_id for h in joined} <= members(current):
            return
        try:
            proposed = self.candidate(joined)
        except PlanError:
            return
        gain = pace(current) / pace(proposed)
        newcomers = tuple(sorted(members(proposed) - members(current)))
        if gain < GROWTH_GAIN or not newcomers:
            log.info("a plan with the standbys would be %.2fx as fast: not worth a switch", gain)
            return
        c.apply(Growing(newcomers, gain))
        c.on_failure(None, f"the mesh re-planned to take {', '.join(newcomers)} in", "replanned")
        self._switch_to(proposed)

    def _switch_to(self, chosen: Plan) -> None:
        """Make ``chosen`` the plan and start it up (under the coordinator's lock)."""
        plan_id = self.coordinator.apply(PlanChosen(chosen)).plan_id
        threading.Thread(
            target=self.coordinator.startup.run, args=(chosen, plan_id), daemon=True
        ).start()

    def retry_later(self, plan_id: int, failure: str) -> None:
        """Start-up of ``plan_id`` failed: plan again after a pause that doubles while it keeps failing."""
        c = self.coordinator
        with c.lock:
            if plan_id != c.plan_id:
                return  # a newer plan is under way
            state = c.apply(StartupFailed(plan_id, failure))
        timer = threading.Timer(state.retry_pause_s(), self.maybe_plan)
        timer.daemon = True
        timer.start()

    def _choose_plan(self, nodes: list[NodeInfo], links: LinkTable) -> Plan:
        locked, config, model = (
            self.options.locked_plan,
            self.options.model_config,
            self.coordinator.model,
        )
        if self.options.private:
            return plan_private(
                model, nodes, links, self._plan_options(), self.coordinator.own_node()
            )
        if locked is None and config is not None:
            return plan_auto(
                model, nodes, links, self._plan_options(), config, self.options.tensor_parallel
            )
        if locked is None:
            return make_plan(model, nodes, links, self._plan_options())
        check_plan(locked, model, nodes, self._plan_options())  # a stale lock is refused, not bent
        return locked

    def _plan_options(self) -> PlanOptions:
        return PlanOptions(context_tokens=self.options.context_length, batch=1)


def pace(plan: Plan) -> float:
    """Seconds per token by what the plan optimised: the slowest stage's step under load
    (throughput), or one token's way through the pipeline (latency)."""
    return plan.slowest_stage_s() if plan.objective == "throughput" else plan.predicted_s_per_token


def current_options(plan: Plan, options: PlanOptions) -> PlanOptions:
    """``options`` with the objective ``plan`` was made for (its pace is compared)."""
    return replace(options, objective=plan.objective)


def members(plan: Plan) -> set[str]:
    """Every node the plan uses, lockstep ranks included."""
    return {node for stage in plan.stages for node in stage.members()}


def layers_of(plan: Plan, node: str) -> int:
    """How many layers ``node`` holds in ``plan`` (a lockstep rank counts its group's)."""
    return sum(s.end - s.start for s in plan.stages if node in s.members())
