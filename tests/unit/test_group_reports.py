"""The coordinator's answer to a node reporting that its lockstep group broke.

A report on the current plan that names a rank of the reporter's own group takes that rank's
node for lost; one that names none forms the group again; either way the requests in flight
end as "lost" (and replay). A report on an older plan, one blaming a node outside the
reporter's group, or one from a node no longer a member, changes nothing. Real links over
socket pairs; the plan is set by hand (its nodes are not speed-checked, so none is started).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from seamline.mesh.control.coordinator import Coordinator, CoordinatorOptions
from seamline.mesh.control.invites import InviteBook
from seamline.mesh.control.mesh_state import (
    NodeAdmitted,
    NodeLost,
    PlanChosen,
    RoutePublished,
)
from seamline.mesh.control.node_handle import NodeHandle
from seamline.mesh.plan.types import ModelSpec, Plan, StageAssignment
from seamline.mesh.protocol.invite import Invite
from seamline.net.link import Link
from seamline.net.messages import PROTOCOL_VERSION, Failure, Join, Resources

GROUPS = (("a", "b"), ("c", "d"))


@pytest.fixture()
def coordinator() -> Iterator[tuple[Coordinator, list[tuple[str | None, str, str]]]]:
    spec = ModelSpec("m", 4, 64, (1 << 20,) * 4, 0, 0, 0, 1024)
    made = Coordinator(
        InviteBook(Invite(("127.0.0.1",), 1, 2, "s", 0.0)), spec, "hash", CoordinatorOptions()
    )
    failures: list[tuple[str | None, str, str]] = []
    made.on_failure = lambda request, reason, blame: failures.append((request, reason, blame))  # type: ignore[assignment,arg-type]
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
    for _ in range(3):  # plan 3 serves
        made.apply(PlanChosen(Plan("m", 4, stages, 0.2, 0.0, 1024, 1)))
    made.apply(RoutePublished(3))
    yield made, failures
    for end in ends:
        end.close()


def _report(
    coordinator: Coordinator,
    reporter: str,
    plan_id: int,
    suspect: str | None,
    request: int | None = 5,
) -> None:
    reason = "lockstep batch failed: rank 1 sent nothing within 3.0 s"
    coordinator._reported(
        coordinator.nodes[reporter],
        Failure(request=request, reason=reason, plan_id=plan_id, suspect=suspect),
    )


def test_a_rank_named_by_its_group_is_lost_and_the_requests_replay(coordinator: tuple) -> None:
    made, failures = coordinator
    _report(made, "a", 3, "b")
    assert "b" not in made.nodes and set(made.nodes) == {"a", "c", "d"}
    assert (
        not made.ready.is_set() and made.plan_id == 3 and made.plan is None
    )  # no checked node: none to plan
    assert failures == [
        (
            None,
            "node b left the mesh mid-request (its lockstep group lost it: lockstep batch failed: "
            "rank 1 sent nothing within 3.0 s)",
            "lost",
        )
    ]


def test_a_group_with_no_rank_named_is_formed_again(coordinator: tuple) -> None:
    made, failures = coordinator
    _report(made, "d", 3, None, request=None)
    assert set(made.nodes) == {"a", "b", "c", "d"} and not made.ready.is_set()
    assert [(r, blame) for r, _, blame in failures] == [(None, "lost")]
    assert failures[0][1].startswith("the lockstep group of d broke mid-request"), failures
    assert made.state.startswith("the lockstep group of d broke; ")


@pytest.mark.parametrize(
    "plan_id, suspect",
    [(2, "b"), (4, "b"), (3, "c"), (3, "zz")],
    ids=["older plan", "newer plan", "outside the group", "not a member"],
)
def test_a_report_on_another_plan_or_blaming_outside_the_group_changes_nothing(
    coordinator: tuple,
    plan_id: int,
    suspect: str,
) -> None:
    made, failures = coordinator
    _report(made, "a", plan_id, suspect)
    assert set(made.nodes) == {"a", "b", "c", "d"} and made.ready.is_set() and made.plan_id == 3
    assert failures == []


def test_a_report_from_a_node_that_is_no_longer_a_member_changes_nothing(
    coordinator: tuple,
) -> None:
    made, failures = coordinator
    gone = made.nodes["a"]
    made.apply(NodeLost("a", "its link closed"))
    made._reported(
        gone, Failure(request=None, reason="rank 1 closed the link", plan_id=3, suspect="b")
    )
    assert set(made.nodes) == {"b", "c", "d"} and made.ready.is_set() and failures == []


def test_a_member_that_says_its_stage_failed_is_lost_and_its_word_implicates_no_request(
    coordinator: tuple,
) -> None:
    """A rank that is neither stage 0's leader nor the drawing stage may not end a request
    (refused, counted), and one that reports its stage failed is taken at its word: lost, the
    requests replaying as "replanned" (a member's word is not a loss seen, which would count
    against the requests it was starting), so one that says so of every request drops itself.
    So is the drawing stage that says so while the mesh serves: its word ends no request either
    (while it re-plans, such a report is of links broken by the switch, and changes nothing)."""
    made, failures = coordinator
    made.in_flight = lambda request: True
    plan = made.plan
    made._reported(
        made.nodes["b"], Failure(request=5, reason="your request is bad", blame="request")
    )
    assert failures == [] and "b" in made.nodes and made.refusals.counts["b"] == 1
    made._reported(made.nodes["d"], Failure(request=5, reason="this stage failed", blame="node"))
    assert "d" not in made.nodes
    assert [(request, blame) for request, _, blame in failures] == [(None, "replanned")]
    made.apply(
        PlanChosen(plan)
    )  # re-planning, "c" drawing: a report now is of links broken by the switch
    made._reported(made.nodes["c"], Failure(request=5, reason="link closed", blame="node"))
    assert "c" in made.nodes
    made.apply(RoutePublished(made.plan_id))  # serving again
    made._reported(made.nodes["c"], Failure(request=5, reason="this stage failed", blame="node"))
    assert "c" not in made.nodes and all(request is None for request, _, _ in failures)
