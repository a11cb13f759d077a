"""The coordinator's state and the typed events that change it.

``apply(state, event)`` is the one place the state changes: a pure function from the state and
an event to the next state. The members, the plan, its id, whether its route serves, and the
line /api/status shows all live in one frozen ``MeshState``; ``state_keeper.StateKeeper``
applies events one at a time and hands each to its listeners (the log, the console's feed,
/metrics). Events that change nothing (a node's report, a request replayed) still pass through,
so that the feed and the counters see every event in one order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

from seamline.mesh.plan.types import Plan

if TYPE_CHECKING:
    from seamline.mesh.control.node_handle import NodeHandle

RETRY_FIRST_S, RETRY_MAX_S = 1.0, 30.0  # a failed start-up is planned again after 1, 2, 4 ... 30 s


@dataclass(frozen=True)
class MeshState:
    nodes: Mapping[str, NodeHandle] = field(default_factory=lambda: MappingProxyType({}))
    plan: Plan | None = None
    plan_id: int = 0  # plans made so far: the current plan's id
    ready: bool = False  # the current plan's route is published and serves
    phase: str = "waiting for nodes"  # what /api/status says the mesh is doing
    cause: str = ""  # why the mesh is re-planning ("" when it is not)
    failed_starts: int = 0  # start-ups failed in a row (the retry's pause doubles with each)
    closing: bool = False  # the mesh is being shut down on purpose

    def retry_pause_s(self) -> float:
        return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, self.failed_starts - 1))


class Event:
    """Something that happened to the mesh; ``kind`` names it in the feed and in /metrics."""

    kind: ClassVar[str] = "event"
    level: ClassVar[int] = logging.INFO  # the feed shows INFO and above

    def describe(self, state: MeshState) -> str:
        """One line for the log and the feed, given the state the event led to."""
        raise NotImplementedError

    def level_in(self, state: MeshState) -> int:
        """How loud it is, given the state it led to (the feed shows INFO and above)."""
        return self.level


@dataclass(frozen=True)
class NodeAdmitted(Event):
    """A node's control link is a member's: it is measured before it may be planned."""

    handle: NodeHandle
    kind: ClassVar[str] = "node_admitted"
    level: ClassVar[int] = logging.DEBUG

    def describe(self, state: MeshState) -> str:
        return f"node {self.handle.node_id} is a member; measuring it"


@dataclass(frozen=True)
class NodeJoined(Event):
    """A member was measured and checked: it may be planned."""

    node_id: str
    peer: str
    relayed: bool
    expected: int
    kind: ClassVar[str] = "node_joined"

    def describe(self, state: MeshState) -> str:
        relayed = "; it takes no inbound connection: relayed" if self.relayed else ""
        return f"node {self.node_id} joined from {self.peer} ({len(state.nodes)} of {self.expected}){relayed}"


@dataclass(frozen=True)
class NodeLost(Event):
    node_id: str
    reason: str
    kind: ClassVar[str] = "node_lost"
    level: ClassVar[int] = logging.WARNING

    def describe(self, state: MeshState) -> str:
        shutting = " (the mesh is shutting down)" if state.closing else ""
        return f"node {self.node_id} left: {self.reason}{shutting}"

    def level_in(self, state: MeshState) -> int:
        return (
            logging.INFO if state.closing else self.level
        )  # nodes leave a mesh stopped on purpose


@dataclass(frozen=True)
class NodeRemoved(Event):
    """The administrator removed a member (a ``NodeLost`` follows if it was joined)."""

    node_id: str
    revoked_invites: tuple[str, ...]
    kind: ClassVar[str] = "node_removed"
    level: ClassVar[int] = logging.WARNING

    def describe(self, state: MeshState) -> str:
        invites = ", ".join(self.revoked_invites)
        said = (
            f"the invite it joined with ({invites}) admits no new node from now on, and the "
            "members that joined with it stay: issue a new invite for new nodes"
            if invites
            else "no invite of this mesh's is on record for it"
        )
        return f"removing node {self.node_id}; its certificate is revoked; {said}"


@dataclass(frozen=True)
class NodeReported(Event):
    """A member's failure report, as it said it (what it means is the coordinator's to judge)."""

    node_id: str
    reason: str
    kind: ClassVar[str] = "node_reported"
    level: ClassVar[int] = logging.WARNING

    def describe(self, state: MeshState) -> str:
        return f"node {self.node_id} reports: {self.reason}"


@dataclass(frozen=True)
class Replanning(Event):
    """The current plan serves no more: its route is withdrawn and a new plan is sought."""

    cause: str
    kind: ClassVar[str] = "replanning"
    level: ClassVar[int] = logging.WARNING

    def describe(self, state: MeshState) -> str:
        return f"{self.cause}; re-planning"


@dataclass(frozen=True)
class Growing(Event):
    """A serving mesh switches to a plan that takes ``newcomers`` in."""

    newcomers: tuple[str, ...]
    gain: float
    kind: ClassVar[str] = "growing"

    def describe(self, state: MeshState) -> str:
        newcomers = ", ".join(self.newcomers)
        return f"planning {newcomers} in: predicted {self.gain:.2f}x the throughput; requests in flight replay"


@dataclass(frozen=True)
class Rebalancing(Event):
    """A serving mesh switches to a plan priced from its stages' measured step times."""

    slowdowns: str  # each node's measured step time over the plan's, relative to the stages' mean
    gain: float
    kind: ClassVar[str] = "rebalancing"

    def describe(self, state: MeshState) -> str:
        return (
            f"the stages measured apart ({self.slowdowns}): re-planning, predicted {self.gain:.2f}x the "
            "throughput; requests in flight replay"
        )


@dataclass(frozen=True)
class PlanChosen(Event):
    plan: Plan
    kind: ClassVar[str] = "plan_chosen"

    def describe(self, state: MeshState) -> str:
        route = " -> ".join(f"{s.node_id}[{s.start},{s.end})" for s in self.plan.stages)
        notes = "".join(f"; {note}" for note in self.plan.notes)  # what a node's GPU could not take
        return f"plan {state.plan_id}: {route}, predicted {self.plan.predicted_s_per_token * 1e3:.1f} ms/token{notes}"


@dataclass(frozen=True)
class NoPlan(Event):
    """No plan can be made now (no member, or they cannot hold the model)."""

    reason: str
    kind: ClassVar[str] = "no_plan"
    level: ClassVar[int] = logging.ERROR

    def describe(self, state: MeshState) -> str:
        return state.phase


@dataclass(frozen=True)
class NoMembers(Event):
    """Every member has gone: the mesh waits for nodes."""

    kind: ClassVar[str] = "no_members"
    level: ClassVar[int] = logging.DEBUG

    def describe(self, state: MeshState) -> str:
        return state.phase


@dataclass(frozen=True)
class StartupStep(Event):
    """How far the start-up of plan ``plan_id`` has come."""

    plan_id: int
    step: str
    kind: ClassVar[str] = "startup_step"
    level: ClassVar[int] = logging.DEBUG

    def describe(self, state: MeshState) -> str:
        return f"plan {self.plan_id}: {self.step}"


@dataclass(frozen=True)
class StartupFailed(Event):
    plan_id: int
    failure: str
    kind: ClassVar[str] = "startup_failed"
    level: ClassVar[int] = logging.ERROR

    def describe(self, state: MeshState) -> str:
        return state.phase


@dataclass(frozen=True)
class RoutePublished(Event):
    plan_id: int
    kind: ClassVar[str] = "route_published"

    def describe(self, state: MeshState) -> str:
        stages = state.plan.stages if state.plan is not None else ()
        return "route published: " + " -> ".join(f"{s.node_id}[{s.start},{s.end})" for s in stages)


@dataclass(frozen=True)
class RequestReplayed(Event):
    """A request lost its route after ``tokens`` tokens; it replays once the mesh serves."""

    tokens: int
    reason: str
    kind: ClassVar[str] = "request_replayed"
    level: ClassVar[int] = logging.WARNING

    def describe(self, state: MeshState) -> str:
        return (
            f"a request lost its route after {self.tokens} tokens ({self.reason}); "
            "replaying it when the mesh is ready"
        )


@dataclass(frozen=True)
class RequestResumed(Event):
    """A replayed request drew its next token: ``route_s`` after it lost its route the mesh served
    again, ``token_s`` after that its replay (the tokens so far prefilled anew) drew the token."""

    tokens: int
    route_s: float
    token_s: float
    kind: ClassVar[str] = "request_resumed"

    def describe(self, state: MeshState) -> str:
        return (
            f"a replayed request resumed after {self.tokens} tokens: the mesh served again "
            f"{self.route_s:.2f} s after its route was lost, its next token {self.token_s:.2f} s "
            "later"
        )


@dataclass(frozen=True)
class ShuttingDown(Event):
    kind: ClassVar[str] = "shutting_down"

    def describe(self, state: MeshState) -> str:
        return "the mesh is shutting down"


def apply(state: MeshState, event: Event) -> MeshState:
    """The state after ``event``. Events about a plan that is no longer current change nothing."""
    change = dataclasses.replace
    if isinstance(event, NodeAdmitted):
        return change(
            state, nodes=MappingProxyType({**state.nodes, event.handle.node_id: event.handle})
        )
    if isinstance(event, NodeLost):
        return change(
            state,
            nodes=MappingProxyType({k: v for k, v in state.nodes.items() if k != event.node_id}),
        )
    if isinstance(event, Replanning):
        return change(state, ready=False, cause=event.cause, phase=f"{event.cause}; re-planning")
    if isinstance(event, Growing):
        return change(state, ready=False, phase=f"taking {', '.join(event.newcomers)} in")
    if isinstance(event, Rebalancing):
        return change(
            state, ready=False, phase="re-balancing the stages from their measured step times"
        )
    if isinstance(event, PlanChosen):
        return change(state, plan=event.plan, plan_id=state.plan_id + 1, ready=False, cause="")
    if isinstance(event, NoPlan):
        phase = f"{state.cause}; {event.reason}" if state.cause else event.reason
        return change(
            state, plan=None, ready=False, phase=phase, cause=""
        )  # the cause is said once
    if isinstance(event, NoMembers):
        return apply(state, NoPlan("waiting for nodes"))
    if isinstance(event, StartupStep) and event.plan_id == state.plan_id:
        return change(state, phase=event.step)
    if isinstance(event, StartupFailed) and event.plan_id == state.plan_id:
        failed = change(state, plan=None, ready=False, failed_starts=state.failed_starts + 1)
        pause = failed.retry_pause_s()
        return change(
            failed, phase=f"start-up failed: {event.failure}; planning again in {pause:.0f} s"
        )
    if (
        isinstance(event, RoutePublished)
        and event.plan_id == state.plan_id
        and state.plan is not None
    ):
        return change(state, ready=True, phase="ready", cause="", failed_starts=0)
    if isinstance(event, ShuttingDown):
        return change(state, closing=True)
    return state
