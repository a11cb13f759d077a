"""The coordinator's state changes only by ``apply(state, event)``, applied one event at a time
on the keeper's thread; the console's feed and /metrics' counters hear the same events."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from seamline.mesh.control.events import EventFeed
from seamline.mesh.control.mesh_state import (
    Event,
    MeshState,
    NodeAdmitted,
    NodeLost,
    NoMembers,
    NoPlan,
    PlanChosen,
    Replanning,
    RoutePublished,
    ShuttingDown,
    StartupFailed,
    StartupStep,
    apply,
)
from seamline.mesh.control.state_keeper import StateKeeper
from seamline.mesh.plan.types import Plan, StageAssignment

PLAN = Plan("m", 4, (StageAssignment("a", 0, 4, True, True, 1, 1, 0.1),), 0.1, 0.0, 1024, 1)


def _handle(node_id: str) -> SimpleNamespace:
    return SimpleNamespace(node_id=node_id)


def _run(events: list[Event], state: MeshState | None = None) -> MeshState:
    state = state or MeshState()
    for event in events:
        state = apply(state, event)
    return state


def test_apply_is_pure_and_members_come_and_go() -> None:
    empty = MeshState()
    one = apply(empty, NodeAdmitted(_handle("a")))  # type: ignore[arg-type]
    two = apply(one, NodeAdmitted(_handle("b")))  # type: ignore[arg-type]
    assert dict(empty.nodes) == {} and list(one.nodes) == ["a"] and list(two.nodes) == ["a", "b"]
    assert list(apply(two, NodeLost("a", "its link closed")).nodes) == ["b"] and list(
        two.nodes
    ) == ["a", "b"]


def test_a_plan_serves_only_once_its_own_route_is_published() -> None:
    started = _run([PlanChosen(PLAN), StartupStep(1, "linking a")])
    assert (started.plan_id, started.ready, started.phase) == (1, False, "linking a")
    stale = _run(
        [PlanChosen(PLAN), StartupStep(2, "loading"), RoutePublished(1), StartupStep(1, "late")],
        started,
    )
    assert (stale.plan_id, stale.ready, stale.phase) == (
        2,
        False,
        "loading",
    )  # plan 1's events change nothing now
    serving = apply(stale, RoutePublished(2))
    assert (serving.ready, serving.phase, serving.plan) == (True, "ready", PLAN)


def test_failed_start_ups_back_off_and_a_published_route_resets_the_count() -> None:
    state = MeshState()
    pauses = []
    for _ in range(7):
        state = apply(
            apply(state, PlanChosen(PLAN)), StartupFailed(state.plan_id + 1, "node a left")
        )
        pauses.append(state.retry_pause_s())
    assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0] and state.plan is None
    assert state.phase == "start-up failed: node a left; planning again in 30 s"
    assert apply(state, StartupFailed(state.plan_id - 1, "old news")) == state
    assert _run([PlanChosen(PLAN), RoutePublished(state.plan_id + 1)], state).failed_starts == 0


def test_a_replan_that_finds_no_plan_says_why_it_began() -> None:
    serving = _run([PlanChosen(PLAN), RoutePublished(1)])
    replanning = apply(serving, Replanning("node a left the mesh"))
    assert (replanning.ready, replanning.phase) == (False, "node a left the mesh; re-planning")
    stuck = apply(replanning, NoPlan("cannot plan: too little memory"))
    assert (
        stuck.plan is None and stuck.phase == "node a left the mesh; cannot plan: too little memory"
    )
    assert (
        apply(stuck, NoMembers()).phase == "waiting for nodes"
    )  # a later one: the cause was said once


def test_the_keeper_applies_every_event_on_its_own_thread_in_one_order() -> None:
    keeper = StateKeeper()
    heard: list[tuple[str, str, int]] = []
    feed = EventFeed()
    keeper.listen(
        lambda event, state: heard.append(
            (threading.current_thread().name, event.kind, len(state.nodes))
        )
    )
    keeper.listen(feed)
    threads = [
        threading.Thread(target=keeper.apply, args=(NodeAdmitted(_handle(f"n{i}")),))
        for i in range(8)
    ]  # type: ignore[arg-type]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {name for name, _, _ in heard} == {"mesh-state"}
    assert [count for _, _, count in heard] == list(range(1, 9))  # none lost to a race
    keeper.apply(PlanChosen(PLAN))
    assert not keeper.ready.is_set()
    state = keeper.apply(RoutePublished(1))
    assert state.ready and keeper.ready.is_set() and keeper.current is state
    assert [e["kind"] for e in feed.recent()] == [
        "plan_chosen",
        "route_published",
    ]  # admissions are DEBUG
    assert (
        feed.recent()[-1]["message"] == "route published: a[0,4)"
        and feed.recent()[-1]["level"] == "info"
    )


def test_nodes_that_leave_a_mesh_shutting_down_are_news_not_warnings() -> None:
    keeper = StateKeeper()
    feed = EventFeed()
    keeper.listen(feed)
    keeper.apply(NodeLost("a", "its link closed"))
    keeper.apply(ShuttingDown())
    keeper.apply(NodeLost("b", "its link closed"))
    assert [(e["level"], e["message"]) for e in feed.recent() if e["kind"] == "node_lost"] == [
        ("warning", "node a left: its link closed"),
        ("info", "node b left: its link closed (the mesh is shutting down)"),
    ]


def test_a_failing_listener_costs_the_others_nothing(caplog: object) -> None:
    keeper = StateKeeper()
    heard: list[str] = []
    keeper.listen(lambda event, state: 1 / 0)
    keeper.listen(lambda event, state: heard.append(event.kind))
    with caplog.at_level(logging.ERROR, logger="seamline.coordinator"):  # type: ignore[attr-defined]
        assert keeper.apply(NodeLost("a", "gone")) == MeshState()
    assert heard == ["node_lost"] and "a listener of the mesh's events failed" in caplog.text  # type: ignore[attr-defined]


def test_a_plan_that_could_not_use_a_gpu_says_so_in_its_event() -> None:
    from dataclasses import replace

    note = "node a: cuda:0 has 0.20 GiB free, less than layer 0 needs there: layers [0,4) run on its CPU"
    state = _run([PlanChosen(replace(PLAN, notes=(note,)))])
    assert note in PlanChosen(replace(PLAN, notes=(note,))).describe(state)
    assert "cuda" not in PlanChosen(PLAN).describe(state)


def test_a_lost_node_still_in_the_serving_plan_reads_not_ready_not_a_key_error() -> None:
    """A node's link closes: ``NodeLost`` drops it from the members at once, while its plan serves
    until the re-plan; what asks the stages then (/metrics, a request) is told the mesh is not ready."""
    from seamline.mesh.control.coordinator import Coordinator
    from seamline.mesh.control.startup import StartupError

    serving = _run([NodeAdmitted(_handle("a")), PlanChosen(PLAN), RoutePublished(1)])  # type: ignore[arg-type]
    ready = threading.Event()
    ready.set()
    coordinator = SimpleNamespace(
        lock=threading.Lock(), ready=ready, keeper=SimpleNamespace(current=serving)
    )
    assert [h.node_id for h in Coordinator.pipeline(coordinator)] == ["a"]  # type: ignore[arg-type]
    coordinator.keeper.current = apply(serving, NodeLost("a", "its link closed"))
    with pytest.raises(StartupError, match="node a left"):
        Coordinator.pipeline(coordinator)  # type: ignore[arg-type]
