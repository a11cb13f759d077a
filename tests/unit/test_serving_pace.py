"""A node that serves clearly slower than it is planned (against its fellow stages, over a
sustained window) is planned at the rate it served; load that slows every stage alike, a short
or light window, and a node a little slow change nothing."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest

from seamline.mesh.control.serving_pace import (
    MIN_STEPS,
    SUSTAINED_S,
    DecodeCounters,
    ServingPace,
    clearly_slow,
    slowdowns,
)
from seamline.mesh.plan.types import Plan, StageAssignment

NODES = ("a", "b", "c")


def _plan() -> Plan:
    ranges = ((0, 10), (10, 20), (20, 30))
    stages = tuple(
        StageAssignment(n, s, e, s == 0, e == 30, 1 << 20, 0, 0.01)
        for n, (s, e) in zip(NODES, ranges)
    )
    return Plan("m", 30, stages, 0.03, 0.0, 1024, 1, "throughput")


def _window(step_s: dict[str, float], steps: int = 200, wall_s: float = SUSTAINED_S) -> tuple:
    before = DecodeCounters(1, 0.0, dict.fromkeys(NODES, 0), dict.fromkeys(NODES, 0.0))
    after = DecodeCounters(
        1, wall_s, dict.fromkeys(NODES, steps), {n: s * steps for n, s in step_s.items()}
    )
    return before, after


def test_a_node_twice_as_slow_as_its_fellows_is_found_and_common_load_is_not() -> None:
    found = slowdowns(_plan(), *_window({"a": 0.02, "b": 0.02, "c": 0.04}))
    assert found == pytest.approx({"a": 1.0, "b": 1.0, "c": 2.0})
    assert clearly_slow(found) == pytest.approx({"c": 2.0})
    every_stage_slow = slowdowns(_plan(), *_window({"a": 0.05, "b": 0.05, "c": 0.05}))
    assert every_stage_slow is not None and not clearly_slow(every_stage_slow)
    a_little = slowdowns(_plan(), *_window({"a": 0.01, "b": 0.01, "c": 0.014}))
    assert a_little is not None and not clearly_slow(a_little)


def test_a_short_light_or_replanned_window_is_not_judged() -> None:
    slow = {"a": 0.01, "b": 0.01, "c": 0.04}
    assert slowdowns(_plan(), *_window(slow, wall_s=SUSTAINED_S / 2)) is None
    assert slowdowns(_plan(), *_window(slow, steps=MIN_STEPS - 1)) is None
    before, after = _window(slow)
    assert slowdowns(_plan(), before, replace(after, plan_id=2)) is None


class _Planning:
    def __init__(self) -> None:
        self.asked: list[dict[str, float]] = []

    def replan_slow(self, plan: Plan, slow: dict[str, float]) -> bool:
        self.asked.append(slow)
        return True


class _Coordinator:
    """The coordinator as the watch sees it: a serving plan, its members, their counters."""

    def __init__(self, step_s: dict[str, float]) -> None:
        from seamline.net.messages import Stats

        self.plan, self.plan_id = replace(_plan(), private=True), 1  # ``balance`` watches the rest
        self.ready = threading.Event()
        self.ready.set()
        self.planning = _Planning()
        self.nodes = {
            n: SimpleNamespace(
                join=SimpleNamespace(resources=SimpleNamespace(bytes_per_second=10e9)),
                proven_rate=5e9,
                served_rate=None,
            )
            for n in NODES
        }
        self.step_s, self.steps, self.stats_type = step_s, 0, Stats

    def own_node(self) -> str:
        return ""

    def stage_stats(self) -> list:
        self.steps += 100
        return [
            self.stats_type(
                node_id=n, decode_steps=self.steps, decode_seconds=self.steps * s, refused_frames=0
            )
            for n, s in self.step_s.items()
        ]


def test_the_watch_lowers_a_slow_nodes_rate_once_and_asks_for_a_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from seamline.mesh.control import serving_pace

    clock = [0.0]
    monkeypatch.setattr(serving_pace.time, "monotonic", lambda: clock[0])
    c = _Coordinator({"a": 0.01, "b": 0.01, "c": 0.03})
    watch = ServingPace(c)  # type: ignore[arg-type]
    for _ in range(4):  # a reading every 10 s: judged once 30 s have passed
        watch.tick()
        clock[0] += SUSTAINED_S / 3
    assert c.planning.asked == [pytest.approx({"c": 3.0})]
    assert c.nodes["c"].served_rate == pytest.approx(1.2 * 5e9 / 3)  # its planned rate over 3
    assert c.nodes["a"].served_rate is None
