"""Re-planning from the stages' measured occupied time (``mesh.control.balance``): the
arithmetic that decides, on stage counters as the nodes report them, and the plan it leads to."""

from __future__ import annotations

import pytest

from seamline.mesh.control.balance import MIN_BUSY, BusyWindow, parted, slowdowns
from seamline.mesh.plan.planner import plan as make_plan
from seamline.mesh.plan.types import ModelSpec, NodeInfo, Plan, PlanOptions, StageAssignment

MS = 1e-3


def _plan(*under_load_s: float) -> Plan:
    stages = tuple(
        StageAssignment(f"n{i}", i, i + 1, i == 0, i == len(under_load_s) - 1, 1, 0, t, load_s=t)
        for i, t in enumerate(under_load_s)
    )
    return Plan("m", len(stages), stages, sum(under_load_s), 0.0, 64, 1, "throughput")


START = BusyWindow(1, 100.0, (0.0, 0.0), (0.0, 0.0))


def _busy(plan_id: int, at_s: float, *busy: float) -> BusyWindow:
    """Counters after a window from START in which each stage ran its forwards back to back and
    waited for work the rest of the time (occupied seconds = busy seconds)."""
    return BusyWindow(plan_id, at_s, busy, tuple(at_s - START.at_s - b for b in busy))


def test_stages_busy_as_predicted_are_not_parted() -> None:
    plan = _plan(10 * MS, 20 * MS)
    found = slowdowns(plan, START, _busy(1, 106.0, 2.9, 6.0))  # 3% apart
    assert found is not None and found["n0"] / found["n1"] == pytest.approx(2.9 / 3.0)
    assert not parted(found)


def test_a_stage_slowed_by_its_core_is_found_relative_to_the_others() -> None:
    plan = _plan(10 * MS, 10 * MS)
    found = slowdowns(
        plan, START, _busy(1, 106.0, 5.9, 4.5)
    )  # stage 0 shares its core with the API
    assert found is not None and found["n0"] / found["n1"] == pytest.approx(5.9 / 4.5)
    assert parted(found)


def test_a_stage_kept_off_its_core_between_its_forwards_is_found_slowed() -> None:
    """Both stages forward as fast as planned, but stage 0 had work 1.8 s more than its forwards
    (the API and the clients ran on its core): 5.8 s occupied against 4.0 s."""
    plan = _plan(10 * MS, 10 * MS)
    found = slowdowns(plan, START, BusyWindow(1, 106.0, (4.0, 4.0), (0.2, 2.0)))
    assert found is not None and found["n0"] / found["n1"] == pytest.approx(5.8 / 4.0)
    assert parted(found)


def test_other_work_while_a_stage_waits_for_work_is_not_its_slowness() -> None:
    """A lull: both stages forward 3 s and wait 3 s for the next burst, whatever ran on stage
    0's core meanwhile; a stage is occupied at least while its forwards run (a clock read a
    little apart from the other never makes it less)."""
    plan = _plan(10 * MS, 10 * MS)
    found = slowdowns(plan, START, BusyWindow(1, 106.0, (3.0, 3.0), (3.0, 3.0)))
    assert found is not None and not parted(found)
    skewed = slowdowns(plan, START, BusyWindow(1, 106.0, (3.0, 3.0), (3.5, 3.0)))
    assert skewed is not None and skewed["n0"] == pytest.approx(skewed["n1"])


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
    assert spent >= 0.5 / len(os.sched_getaffinity(0)), (
        spent
    )  # the spinner's second, shared over our cores


def test_an_idle_pipeline_or_a_new_plan_decides_nothing() -> None:
    plan = _plan(10 * MS, 10 * MS)
    assert slowdowns(plan, START, _busy(1, 106.0, MIN_BUSY * 6 - 0.1, 1.0)) is None
    assert slowdowns(plan, START, _busy(2, 106.0, 5.0, 3.0)) is None


def test_corrected_rates_move_layers_off_the_slowed_node() -> None:
    """What ``Planning.rebalance`` plans: the slowed node's rate over its slowdown gives it fewer layers."""
    model = ModelSpec("m", 24, 64, (1000,) * 24, 500, 500, 10, 256)
    options = PlanOptions(context_tokens=64)
    even = make_plan(
        model, [NodeInfo("a", 1 << 30, 1e6), NodeInfo("b", 1 << 30, 1e6)], None, options
    )
    slowed = make_plan(
        model, [NodeInfo("a", 1 << 30, 1e6 / 1.3), NodeInfo("b", 1 << 30, 1e6)], None, options
    )
    layers = {s.node_id: s.end - s.start for s in slowed.stages}
    assert {s.node_id: s.end - s.start for s in even.stages} == {"a": 12, "b": 12}
    assert layers["a"] < layers["b"]
    assert slowed.slowest_stage_s() < max(
        s.compute_s * 1.3 if s.node_id == "a" else s.compute_s for s in even.stages
    )


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
        other = price_route(
            model, list(nodes.values()), None, options, [("b", 0, cut), ("a", cut, 24)]
        )
        assert pace <= other.slowest_stage_s() + 1e-12
    tight = {"b": NodeInfo("b", 256 << 20, 1e6), "a": NodeInfo("a", 256 << 20, 1e6)}
    assert (
        least_bottleneck_cuts(model, tight, options, ["b", "a"]) is None
    )  # neither holds anything


class _Coordinator:
    """What ``Balance`` reads of a coordinator: the serving plan, its stages' counters, and
    ``planning.rebalance`` (here it records the corrections it was asked with)."""

    def __init__(self, plan: Plan, switches: bool) -> None:
        import threading
        from types import SimpleNamespace

        self.plan, self.plan_id, self.ready = plan, 1, threading.Event()
        self.ready.set()
        self.busy = [0.0, 0.0]
        self.idle = [0.0, 0.0]  # each stage's seconds waiting with nothing to run
        self.asked: list[dict[str, float]] = []
        self.switches = switches
        self.planning = SimpleNamespace(rebalance=self._rebalance)
        self.balance: object = None

    def stage_stats(self) -> list[object]:
        from seamline.net.messages import Stats

        return [
            Stats(
                node_id=f"n{i}",
                decode_steps=0,
                decode_seconds=0.0,
                refused_frames=0,
                busy_seconds=b,
                idle_seconds=i,
            )
            for i, (b, i) in enumerate(zip(self.busy, self.idle))
        ]

    def _rebalance(self, plan: Plan, found: dict[str, float], needed: float) -> bool:
        self.asked.append(dict(self.balance.corrections))  # type: ignore[attr-defined]
        if self.switches:
            self.plan_id += 1
        return self.switches


def _ticks(
    coordinator: _Coordinator,
    balance: object,
    windows: int,
    busy: list[tuple[float, float]] | None = None,
    idle: list[tuple[float, float]] | None = None,
) -> None:
    """``windows`` windows of 6 s, each adding ``busy`` seconds to the stages in turn (by default
    stage 0 busy 1.5x stage 1, under a plan that predicts them equal) and ``idle`` seconds (by
    default the rest of the window), the balance ticking at each."""
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
            waited = idle[window % len(idle)] if idle else (6.0 - add[0], 6.0 - add[1])
            coordinator.idle = [coordinator.idle[0] + waited[0], coordinator.idle[1] + waited[1]]
    finally:
        module.time.monotonic = real  # type: ignore[assignment]


def _watched(switches: bool = True, plan: Plan | None = None) -> tuple[_Coordinator, object]:
    from seamline.mesh.control.balance import Balance

    coordinator = _Coordinator(plan or _plan(10 * MS, 10 * MS), switches=switches)
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
    _ticks(
        coordinator, balance, LOADED_WINDOWS, busy=[(4.5, 3.0)]
    )  # one window short (the first tick starts one)
    assert coordinator.asked == []
    coordinator, balance = _watched()
    _ticks(
        coordinator, balance, LOADED_WINDOWS + 1, busy=[(4.5, 3.0)]
    )  # the same way in every window: re-planned
    assert len(coordinator.asked) == 1


def test_a_window_over_a_lull_between_bursts_does_not_rebalance_a_good_cut() -> None:
    """Windows read on a 1 GbE mesh, waves of 64 clients one after another (each stage's busy
    and idle seconds, 6 s each). At 16 layers on stage 0, eight loaded windows, one over the
    lull between two waves (both stages waiting 2.3-2.5 s for the next wave while its client
    process and arrivals took 2.6 s of stage 0's core: counted as stage 0's slowness, that four
    had read 1.23x and switched the cut); their occupied seconds read 1.02x for the first four,
    1.06x for all eight. At 14 layers, stage 1 the busier by a fifth, the first four part at once."""
    coordinator, balance = _watched()
    busy = [
        (6.15, 6.64),
        (4.12, 4.85),
        (3.66, 2.73),
        (5.73, 5.58),
        (3.16, 3.63),
        (4.89, 3.95),
        (5.45, 5.73),
        (5.95, 4.5),
    ]
    idle = [
        (0.42, 0.01),
        (1.53, 1.0),
        (2.06, 3.09),
        (0.5, 0.71),
        (2.53, 2.25),
        (0.89, 1.94),
        (0.71, 0.54),
        (0.0, 1.45),
    ]
    _ticks(coordinator, balance, len(busy) + 1, busy, idle)
    assert coordinator.asked == []
    coordinator, balance = _watched()
    busy = [(4.29, 6.29), (3.49, 4.63), (3.89, 3.32), (4.14, 6.27)]
    idle = [(1.66, 0.03), (2.15, 1.27), (1.86, 2.35), (1.83, 0.02)]
    _ticks(coordinator, balance, len(busy) + 1, busy, idle)
    assert (
        len(coordinator.asked) == 1 and coordinator.asked[0]["n0"] > 1 > coordinator.asked[0]["n1"]
    )


def test_a_plan_that_read_even_is_not_switched_by_four_windows_at_the_ends_of_bursts() -> None:
    """Windows read on a 1 GbE mesh at 15 layers on stage 0 (the plan priced them 1.746 and
    1.828 ms), waves of 64 clients: eight windows even (1.02x and 1.00x), then four at the ends
    of bursts, where few rows are left and the stage with the head is the slower (stage 0
    waiting 2.3-2.9 s of two of them): 0.79x alone, which switched the cut when four windows
    decided alone. Taken with the plan's eight before them: 0.94x, kept."""
    plan = _plan(1.746 * MS, 1.828 * MS)
    busy = [
        (5.42, 6.34),
        (5.86, 6.11),
        (3.53, 4.24),
        (4.45, 3.74),
        (5.37, 6.13),
        (6.06, 5.31),
        (5.08, 5.73),
        (5.41, 6.29),
        (3.89, 4.68),
        (3.6, 3.2),
        (4.31, 6.37),
        (2.93, 5.85),
    ]
    idle = [
        (0.65, 0.0),
        (0.45, 0.15),
        (2.11, 1.65),
        (1.19, 1.99),
        (0.75, 0.09),
        (0.0, 0.76),
        (0.86, 0.46),
        (0.57, 0.0),
        (1.71, 1.19),
        (1.97, 2.55),
        (2.29, 0.0),
        (2.9, 0.07),
    ]
    coordinator, balance = _watched(plan=plan)
    _ticks(coordinator, balance, len(busy) + 1, busy, idle)
    assert coordinator.asked == []
    coordinator, balance = _watched(plan=plan)
    _ticks(
        coordinator, balance, 5, busy[-4:], idle[-4:]
    )  # the four alone, on a plan that read nothing before
    assert (
        len(coordinator.asked) == 1 and coordinator.asked[0]["n1"] < 1 < coordinator.asked[0]["n0"]
    )


def test_a_decision_takes_the_latest_loaded_windows_and_follows_a_load_that_changes() -> None:
    """Stage 0 busy 1.5x stage 1 for the plan's first sixteen windows, even for the next sixteen:
    every fourth window decides over the latest sixteen, so the four decisions in the first,
    then two more while the parted ones outweigh (1.33x, 1.2x), then none (1.09x, 1.0x); taken
    since the plan began, the parted ones would have gone on deciding (1.24x, 1.2x)."""
    from seamline.mesh.control.balance import KEPT_WINDOWS

    coordinator, balance = _watched(switches=False)
    turns = [(4.5, 3.0)] * KEPT_WINDOWS + [(4.5, 4.5)] * KEPT_WINDOWS
    _ticks(coordinator, balance, len(turns) + 1, busy=turns)
    assert len(coordinator.asked) == 6


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


def test_a_set_of_members_is_rebalanced_a_few_times_at_most_and_a_kept_plan_does_not_compound() -> (
    None
):
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
    assert (
        len(kept.asked) > MAX_SWITCHES
    )  # a plan kept is looked at again, but its corrections are the same
    mean = (1.5 + 1.0) / 2
    expected = 1 / (1.5 / mean) ** DAMPING
    assert all(asked["n0"] == pytest.approx(expected) for asked in kept.asked)


def test_a_correction_back_the_way_the_last_switch_went_goes_part_of_the_way() -> None:
    """Stage 0 busy 1.5x stage 1 at one plan, the other way round at the plan that switch made
    (the best cut lies between them): the second switch moves each node's correction back by
    ``REVERSAL`` of its measured move, not the whole (which had switched back and forth between
    two cuts); a third the same way as the second goes the whole way."""
    from seamline.mesh.control.balance import DAMPING, LOADED_WINDOWS, REVERSAL

    coordinator, balance = _watched()
    windows = LOADED_WINDOWS + 1  # a plan's first tick reads nothing: its windows start there
    _ticks(
        coordinator, balance, 3 * windows, busy=[(4.5, 3.0)] * windows + [(3.0, 4.5)] * 2 * windows
    )
    assert len(coordinator.asked) == 3
    first, second, third = coordinator.asked
    slow, fast = 4.5 / 3.75, 3.0 / 3.75  # each stage's busy seconds over their mean
    assert first == pytest.approx({"n0": slow**-DAMPING, "n1": fast**-DAMPING})
    assert second == pytest.approx(
        {
            "n0": first["n0"] * fast ** (-DAMPING * REVERSAL),
            "n1": first["n1"] * slow ** (-DAMPING * REVERSAL),
        }
    )
    assert (
        first["n0"] < second["n0"] < 1.0 < second["n1"] < first["n1"]
    )  # back toward even, not past it
    assert third == pytest.approx(
        {"n0": second["n0"] * fast**-DAMPING, "n1": second["n1"] * slow**-DAMPING}
    )


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


def test_a_plan_is_settled_once_a_decision_under_load_kept_it_or_none_will_come() -> None:
    """What ``bench scale`` waits for before it holds a plan: a new plan is not settled until
    a decision over its own loaded windows kept it; one that switched is not; a held plan, or a
    plan of one stage, is."""
    from seamline.mesh.control.balance import LOADED_WINDOWS

    coordinator, balance = _watched()
    assert not balance.settled()  # type: ignore[attr-defined]
    _ticks(coordinator, balance, LOADED_WINDOWS + 1)  # parted: switched to plan 2
    assert coordinator.plan_id == 2 and not balance.settled()  # type: ignore[attr-defined]
    _ticks(coordinator, balance, LOADED_WINDOWS + 1, busy=[(4.5, 4.5)])  # plan 2 reads even: kept
    assert coordinator.plan_id == 2 and balance.settled()  # type: ignore[attr-defined]
    coordinator, balance = _watched()
    balance.held = True  # type: ignore[attr-defined]
    assert balance.settled()  # type: ignore[attr-defined]
    coordinator, balance = _watched(plan=_plan(10 * MS))
    assert balance.settled()  # type: ignore[attr-defined]
