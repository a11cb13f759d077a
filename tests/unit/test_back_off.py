"""A member that failed waits before it is planned again, longer with each failure in a row, and
starts over once it has gone a while without failing; a stage that refused a request's frame
ends that request's attempt at once (it replays), whichever stage it is."""

from __future__ import annotations

from seamline.mesh.control import back_off
from seamline.mesh.control.back_off import BackOff
from seamline.net.messages import Failure
from tests.unit.test_group_reports import coordinator  # noqa: F401  (the fixture)


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
    coordinator: tuple,  # noqa: F811
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
    coordinator: tuple,  # noqa: F811
) -> None:
    made, failures = coordinator
    made.in_flight = lambda request: True
    made._reported(made.nodes["d"], Failure(request=5, reason="this stage failed", blame="node"))
    assert "d" not in made.nodes and set(made.back_off.waiting()) == {"d"}
    assert made.back_off.waiting()["d"] > back_off.FIRST_WAIT_S - 5


def test_a_stage_that_calls_a_validated_request_invalid_has_failed_itself(
    coordinator: tuple,  # noqa: F811
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
