"""A member that failed waits before it is planned again, longer with each failure in a row, and
starts over once it has gone a while without failing; a stage that refused a request's frame
ends that request's attempt at once (it replays), whichever stage it is; a stage that calls a
request the API validated invalid is taken as failed itself. Real links over socket pairs; the
plan (stage 0 "a" and "b" in lockstep, the drawing stage "c" and "d") is set by hand."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from seamline.mesh.control import back_off
from seamline.mesh.control.back_off import BackOff
from seamline.mesh.control.coordinator import Coordinator, CoordinatorOptions
from seamline.mesh.control.invites import InviteBook
from seamline.mesh.control.mesh_state import NodeAdmitted, PlanChosen, RoutePublished
from seamline.mesh.control.node_handle import NodeHandle
from seamline.mesh.plan.types import ModelSpec, Plan, StageAssignment
from seamline.mesh.protocol.invite import Invite
from seamline.net.link import Link
from seamline.net.messages import PROTOCOL_VERSION, Failure, Join, Resources

GROUPS = (("a", "b"), ("c", "d"))


@pytest.fixture()
def coordinator() -> Iterator[tuple[Coordinator, list[tuple[int | None, str, str]]]]:
    spec = ModelSpec("m", 4, 64, (1 << 20,) * 4, 0, 0, 0, 1024)
    made = Coordinator(
        InviteBook(Invite(("127.0.0.1",), 1, 2, "s", 0.0)), spec, "hash", CoordinatorOptions()
    )
    failures: list[tuple[int | None, str, str]] = []
    made.on_failure = lambda request, reason, blame: failures.append((request, reason, blame))
    ends = []
    for ranks in GROUPS:
        for node_id in ranks:
            ours, theirs = socket.socketpair()
            ends.append(theirs)
            join = Join(
                node_id=node_id,
                proof="p",
                protocol_version=PROTOCOL_VERSION,
                resources=Resources(free_memory_bytes=1 << 30, bytes_per_second=1e9),
                data_host="h",
                data_port=1,
            )
            made.apply(NodeAdmitted(NodeHandle(join, Link(ours, node_id))))
    stages = tuple(
        StageAssignment(r[0], 2 * i, 2 * i + 2, i == 0, i == 1, 1, 1, 0.1, ranks=r)
        for i, r in enumerate(GROUPS)
    )
    made.apply(PlanChosen(Plan("m", 4, stages, 0.2, 0.0, 1024, 1)))
    made.apply(RoutePublished(made.plan_id))
    yield made, failures
    for end in ends:
        end.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Member:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id


def test_each_failure_in_a_row_doubles_the_wait_and_a_while_served_well_starts_over() -> None:
    clock = Clock()
    waits = BackOff(lambda: None, clock)
    first = back_off.FIRST_WAIT_S
    assert waits.strike("a", "lost") == first
    assert waits.ready([Member("a"), Member("b")])[0].node_id == "b"
    assert waits.waiting() == {"a": first}
    clock.now += first
    assert waits.waiting_s("a") == 0.0 and len(waits.ready([Member("a")])) == 1
    assert waits.strike("a", "lost again") == 2 * first  # it failed soon after it came back
    clock.now += 2 * first + 1
    assert waits.strike("a", "and again") == 4 * first
    for _ in range(10):
        waits.strike("a", "again")
    assert waits.waiting_s("a") == back_off.MOST_WAIT_S
    clock.now += back_off.MOST_WAIT_S + back_off.SERVED_WELL_S
    assert waits.strike("a", "once, after a long while") == first


def test_a_refused_frame_ends_the_attempt_of_a_request_in_flight_from_any_stage(
    coordinator: tuple,
) -> None:
    """Any planned stage may say it refused a request's frame: the request's attempt ends as
    "replanned" (it replays at once, counting against no node). Of a request not in flight, or
    from a node outside the plan, the report changes nothing; no member is lost either way."""
    made, failures = coordinator
    in_flight = {5}
    made.in_flight = in_flight.__contains__
    refused = Failure(request=5, reason="refused frame: out of step", blame="frame")
    made._reported(made.nodes["b"], refused)  # a rank that may not end a request
    assert [(request, blame) for request, _, blame in failures] == [(5, "replanned")]
    made._reported(made.nodes["c"], refused.model_copy(update={"request": 6}))
    assert len(failures) == 1 and set(made.nodes) == {"a", "b", "c", "d"}
    assert made.back_off.waiting() == {}


def test_a_planned_member_that_says_its_stage_failed_is_backed_off(
    coordinator: tuple,
) -> None:
    made, failures = coordinator
    made.in_flight = lambda request: True
    made._reported(made.nodes["d"], Failure(request=5, reason="this stage failed", blame="node"))
    assert "d" not in made.nodes and set(made.back_off.waiting()) == {"d"}
    assert made.back_off.waiting()["d"] > back_off.FIRST_WAIT_S - 5


def test_a_stage_that_calls_a_validated_request_invalid_has_failed_itself(
    coordinator: tuple,
) -> None:
    """Stage 0 may find a request at fault as it admits it (its room), before its first token;
    a request with a grammar may be found at fault by the drawing stage. Anything else the API
    validated: the stage that says so is taken for failed (lost, backed off), and the request
    replays ("replanned"), never ended as invalid."""
    made, failures = coordinator
    made.in_flight = lambda request: True
    made.opened.opened(7, grammar=False)
    made.opened.opened(8, grammar=True)
    made.opened.opened(9, grammar=False)
    made._reported(made.nodes["a"], Failure(request=7, reason="no room", blame="request"))
    made._reported(made.nodes["c"], Failure(request=8, reason="grammar", blame="request"))
    assert [(r, blame) for r, _, blame in failures] == [(7, "request"), (8, "request")]
    made.opened.drew([9])
    made._reported(made.nodes["c"], Failure(request=9, reason="invalid", blame="request"))
    assert "c" not in made.nodes and set(made.back_off.waiting()) == {"c"}
    assert [(r, blame) for r, _, blame in failures[2:]] == [(None, "replanned")]
