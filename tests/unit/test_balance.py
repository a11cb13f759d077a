"""Re-planning from the stages' measured busy time (``mesh.control.balance``): the arithmetic
that decides, on stage counters as the nodes report them, and the plan it leads to."""

from __future__ import annotations

import pytest

from seamline.mesh.control.balance import MIN_BUSY, MIN_FREE, Window, parted, slowdowns
from seamline.mesh.plan.planner import plan as make_plan
from seamline.mesh.plan.types import ModelSpec, NodeInfo, Plan, PlanOptions, StageAssignment

MS = 1e-3


def _plan(*under_load_s: float) -> Plan:
    stages = tuple(StageAssignment(f"n{i}", i, i + 1, i == 0, i == len(under_load_s) - 1, 1, 0, t, load_s=t)
                   for i, t in enumerate(under_load_s))  # fmt: skip
    return Plan("m", len(stages), stages, sum(under_load_s), 0.0, 64, 1, "throughput")


START = Window(1, 100.0, (0.0, 0.0))


def test_stages_busy_as_predicted_are_not_parted() -> None:
    plan = _plan(10 * MS, 20 * MS)
    found = slowdowns(plan, START, Window(1, 106.0, (2.9, 6.0)))  # 3% apart
    assert found is not None and found["n0"] / found["n1"] == pytest.approx(2.9 / 3.0)
    assert not parted(found)


def test_a_stage_slowed_by_its_core_is_found_relative_to_the_others() -> None:
    plan = _plan(10 * MS, 10 * MS)
    found = slowdowns(plan, START, Window(1, 106.0, (5.9, 4.5)))  # stage 0 shares its core with the API
    assert found is not None and found["n0"] / found["n1"] == pytest.approx(5.9 / 4.5)
    assert parted(found)


def test_a_stage_whose_core_runs_other_work_between_its_forwards_is_found_slowed() -> None:
    """Stage 0 forwards as fast as planned, but the API and the clients take 30% of its core."""
    plan = _plan(10 * MS, 10 * MS)
    before = Window(1, 100.0, (0.0, 0.0), (50.0, 7.0))
    found = slowdowns(plan, before, Window(1, 106.0, (4.0, 4.0), (51.8, 7.0)))
    assert found is not None and found["n0"] / found["n1"] == pytest.approx(1 / 0.7)
    assert parted(found)
    nearly_all = slowdowns(plan, before, Window(1, 106.0, (4.0, 4.0), (56.0, 7.0)))  # a core all taken: floored
    assert nearly_all is not None and nearly_all["n0"] / nearly_all["n1"] == pytest.approx(1 / MIN_FREE)


def test_others_cpu_seconds_counts_another_process_on_this_core() -> None:
    import os
    import subprocess
    import sys
    import time

    from seamline.mesh.node.core_load import others_cpu_seconds

    core = min(os.sched_getaffinity(0))
    before = others_cpu_seconds()
    spin = "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"
    subprocess.run(["taskset", "-c", str(core), sys.executable, "-c", spin], check=True, timeout=60)
    time.sleep(0.05)
    spent = others_cpu_seconds() - before
    assert spent >= 0.5 / len(os.sched_getaffinity(0)), spent  # the spinner's second, shared over our cores


def test_an_idle_pipeline_or_a_new_plan_decides_nothing() -> None:
    plan = _plan(10 * MS, 10 * MS)
    assert slowdowns(plan, START, Window(1, 106.0, (MIN_BUSY * 6 - 0.1, 1.0))) is None
    assert slowdowns(plan, START, Window(2, 106.0, (5.0, 3.0))) is None


def test_corrected_rates_move_layers_off_the_slowed_node() -> None:
    """What ``Planning.rebalance`` plans: the slowed node's rate over its slowdown gives it fewer layers."""
    model = ModelSpec("m", 24, 64, (1000,) * 24, 500, 500, 10, 256)
    options = PlanOptions(context_tokens=64)
    even = make_plan(model, [NodeInfo("a", 1 << 30, 1e6), NodeInfo("b", 1 << 30, 1e6)], None, options)
    slowed = make_plan(model, [NodeInfo("a", 1 << 30, 1e6 / 1.3), NodeInfo("b", 1 << 30, 1e6)], None, options)
    layers = {s.node_id: s.end - s.start for s in slowed.stages}
    assert {s.node_id: s.end - s.start for s in even.stages} == {"a": 12, "b": 12}
    assert layers["a"] < layers["b"]
    assert slowed.slowest_stage_s() < max(s.compute_s * 1.3 if s.node_id == "a" else s.compute_s for s in even.stages)


def test_a_rebalance_moves_the_cuts_and_keeps_each_node_in_its_place() -> None:
    """``least_bottleneck_cuts``: the route's order is kept (a node's correction was measured in
    its place); the slowed first node gives layers to the second, and the cuts are the best."""
    from seamline.mesh.plan.cuts import least_bottleneck_cuts
    from seamline.mesh.plan.pricing import price_route

    model = ModelSpec("m", 24, 64, (1000,) * 24, 500, 500, 10, 256)
    options = PlanOptions(context_tokens=64)
    nodes = {"b": NodeInfo("b", 1 << 30, 1e6 / 1.3), "a": NodeInfo("a", 1 << 30, 1e6)}
    route = least_bottleneck_cuts(model, nodes, options, ["b", "a"])
    assert route is not None and [n for n, _, _ in route] == ["b", "a"]
    assert route[0][2] - route[0][1] < route[1][2] - route[1][1]
    pace = price_route(model, list(nodes.values()), None, options, route).slowest_stage_s()
    for cut in range(1, 24):  # no other cut of this order is faster
        other = price_route(model, list(nodes.values()), None, options, [("b", 0, cut), ("a", cut, 24)])
        assert pace <= other.slowest_stage_s() + 1e-12
    tight = {"b": NodeInfo("b", 256 << 20, 1e6), "a": NodeInfo("a", 256 << 20, 1e6)}
    assert least_bottleneck_cuts(model, tight, options, ["b", "a"]) is None  # neither holds anything


class _Coordinator:
    """What ``Balance`` reads of a coordinator: the serving plan, its stages' counters, and
    ``planning.rebalance`` (here it records the corrections it was asked with)."""

    def __init__(self, plan: Plan, switches: bool) -> None:
        import threading
        from types import SimpleNamespace

        self.plan, self.plan_id, self.ready = plan, 1, threading.Event()
        self.ready.set()
        self.busy = [0.0, 0.0]
        self.others = [0.0, 0.0]  # other processes' CPU seconds on each stage's core
        self.asked: list[dict[str, float]] = []
        self.switches = switches
        self.planning = SimpleNamespace(rebalance=self._rebalance)
        self.balance: object = None

    def stage_stats(self) -> list[object]:
        from seamline.net.messages import Stats

        return [Stats(node_id=f"n{i}", decode_steps=0, decode_seconds=0.0, refused_frames=0, busy_seconds=b,
                      core_others_seconds=o) for i, (b, o) in enumerate(zip(self.busy, self.others))]

    def _rebalance(self, plan: Plan, found: dict[str, float], needed: float) -> bool:
        self.asked.append(dict(self.balance.corrections))  # type: ignore[attr-defined]
        if self.switches:
            self.plan_id += 1
        return self.switches


def _ticks(coordinator: _Coordinator, balance: object, windows: int,
           busy: list[tuple[float, float]] | None = None, others: list[tuple[float, float]] | None = None) -> None:
    """``windows`` windows of 6 s, each adding ``busy`` seconds to the stages in turn (by default
    stage 0 busy 1.5x stage 1, under a plan that predicts them equal) and ``others`` to their
    cores' other processes' CPU (by default none), the balance ticking at each."""
    import seamline.mesh.control.balance as module

    clock = [100.0]
    real = module.time.monotonic
    module.time.monotonic = lambda: clock[0]  # type: ignore[assignment]
    turns = busy or [(4.5, 3.0)]
    try:
        for window in range(windows):
            balance.tick()  # type: ignore[attr-defined]
            clock[0] += 6.0
            add = turns[window % len(turns)]
            coordinator.busy = [coordinator.busy[0] + add[0], coordinator.busy[1] + add[1]]
            more = others[window % len(others)] if others else (0.0, 0.0)
            coordinator.others = [coordinator.others[0] + more[0], coordinator.others[1] + more[1]]
    finally:
        module.time.monotonic = real  # type: ignore[assignment]


def _watched(switches: bool = True) -> tuple[_Coordinator, object]:
    from seamline.mesh.control.balance import Balance

    coordinator = _Coordinator(_plan(10 * MS, 10 * MS), switches=switches)
    balance = Balance(coordinator)  # type: ignore[arg-type]
    coordinator.balance = balance
    return coordinator, balance


def test_windows_parted_in_opposite_ways_never_rebalance() -> None:
    """Prompts then decode rows: a window slows stage 0, the next stage 1, by 1.5x each time."""
    from seamline.mesh.control.balance import LOADED_WINDOWS

    coordinator, balance = _watched()
    _ticks(coordinator, balance, 30, busy=[(4.5, 3.0), (3.0, 4.5)])
    assert coordinator.asked == []
    coordinator, balance = _watched()
    _ticks(coordinator, balance, LOADED_WINDOWS, busy=[(4.5, 3.0)])  # one window short (the first tick starts one)
    assert coordinator.asked == []
    coordinator, balance = _watched()
    _ticks(coordinator, balance, LOADED_WINDOWS + 1, busy=[(4.5, 3.0)])  # the same way in every window: re-planned
    assert len(coordinator.asked) == 1


def test_a_window_over_a_lull_between_bursts_does_not_rebalance_a_good_cut() -> None:
    """Windows read on a 1 GbE mesh, waves of 64 clients one after another (busy and other
    processes' CPU seconds per stage, 6 s each). At its best cut they were within 10% of each
    other but for one over the lull between two waves (the stages busy half of it, the next wave's
    client process and arrivals on stage 0's core: stage 0 read 1.23x slow), which with the next
    (1.11x) had re-balanced it to a worse cut. At that cut, stage 1 the busier, they part at once."""
    coordinator, balance = _watched()
    busy = [(5.71, 6.34), (4.7, 5.51), (2.58, 1.87), (5.79, 5.91), (4.46, 5.48), (5.56, 6.14), (2.88, 3.31),
            (5.54, 4.79), (5.71, 6.34)]  # fmt: skip
    others = [(0.19, 0.16), (0.98, 0.06), (2.89, 0.44), (0.26, 0.13), (1.1, 0.11), (0.43, 0.13), (2.85, 0.27),
              (0.57, 0.17), (0.19, 0.16)]  # fmt: skip
    _ticks(coordinator, balance, len(busy) + 1, busy, others)
    assert coordinator.asked == []
    coordinator, balance = _watched()
    busy = [(5.81, 6.07), (2.62, 6.2), (2.47, 2.46), (4.85, 6.03), (3.57, 6.22)]
    others = [(0.14, 0.15), (0.62, 0.03), (2.93, 0.42), (0.2, 0.12), (0.84, 0.02)]
    _ticks(coordinator, balance, len(busy) + 1, busy, others)
    assert len(coordinator.asked) == 1 and coordinator.asked[0]["n0"] > 1 > coordinator.asked[0]["n1"]


def test_a_rebalance_weighs_the_loaded_windows_together() -> None:
    """Stage 0 measured 2x stage 1, then 1.25x, twice over: planned from the four windows
    together (9.75 s against 6 s each pair), not from the last window alone."""
    from seamline.mesh.control.balance import DAMPING, LOADED_WINDOWS

    coordinator, balance = _watched(switches=False)
    _ticks(coordinator, balance, LOADED_WINDOWS + 1, busy=[(6.0, 3.0), (3.75, 3.0)])
    assert len(coordinator.asked) == 1
    mean = (9.75 + 6.0) / 2
    assert coordinator.asked[0]["n0"] == pytest.approx(1 / (9.75 / mean) ** DAMPING)
    assert coordinator.asked[0]["n1"] == pytest.approx(1 / (6.0 / mean) ** DAMPING)


def test_a_set_of_members_is_rebalanced_a_few_times_at_most_and_a_kept_plan_does_not_compound() -> None:
    from seamline.mesh.control.balance import DAMPING, MAX_SWITCHES, Balance

    switching = _Coordinator(_plan(10 * MS, 10 * MS), switches=True)
    balance = Balance(switching)  # type: ignore[arg-type]
    switching.balance = balance
    _ticks(switching, balance, 30)
    assert len(switching.asked) == MAX_SWITCHES
    kept = _Coordinator(_plan(10 * MS, 10 * MS), switches=False)
    balance = Balance(kept)  # type: ignore[arg-type]
    kept.balance = balance
    _ticks(kept, balance, 30)
    assert len(kept.asked) > MAX_SWITCHES  # a plan kept is looked at again, but its corrections are the same
    mean = (1.5 + 1.0) / 2
    expected = 1 / (1.5 / mean) ** DAMPING
    assert all(asked["n0"] == pytest.approx(expected) for asked in kept.asked)


def test_a_held_plan_is_not_rebalanced_until_released() -> None:
    from seamline.mesh.control.balance import LOADED_WINDOWS, Balance

    coordinator = _Coordinator(_plan(10 * MS, 10 * MS), switches=True)
    balance = Balance(coordinator)  # type: ignore[arg-type]
    coordinator.balance = balance
    balance.held = True
    _ticks(coordinator, balance, 10)
    assert coordinator.asked == [] and balance.corrections == {}
    balance.held = False
    _ticks(coordinator, balance, LOADED_WINDOWS + 1)  # parted in the loaded windows, as before
    assert len(coordinator.asked) == 1
