"""`bench scale`'s calibration: a mesh's status (its probes and links) as the simulator's route."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from seamline.sim.costs import FrontCost
from seamline_bench.scale_calibration import (
    Calibration,
    StageProbe,
    _rank_share,
    _stage_probe,
    node_beside_front,
    predict,
)
from seamline_bench.servers import Server

pytest.importorskip("simpy")

HIDDEN = 576
ONE_NODE = {
    "node_id": "a",
    "layers": [0, 30],
    "weight_bytes": 60_000_000,
    "ranks": ["a"],
    "step_probe_ms": {"1": 20.0, "16": 100.0, "64": 300.0},
    "prompt_probe_ms": {"256": 800.0},
}


def status(stages: list[dict], links: list[dict] | None = None) -> dict:
    nodes = [{"node_id": n, "rtt_ms": 0.2, "bandwidth_mb_s": 900.0} for n in ("a", "b")]
    return {"stages": stages, "links": links or [], "nodes": nodes}


def test_a_lockstep_group_takes_a_probed_nodes_rate_over_each_ranks_bytes_and_two_gates_a_layer() -> (
    None
):
    probe = _stage_probe(ONE_NODE, status([ONE_NODE]), None)
    group = {"node_id": "a", "layers": [0, 30], "weight_bytes": 30_000_000, "ranks": ["a", "b"]}
    link = {"nodes": ["a", "b"], "rtt_ms": 0.1, "bandwidth_mb_s": 1000.0}
    found = _stage_probe(group, status([group], [link]), probe)
    assert found.ranks == 2 and found.gate_link_ms_mb_s == (0.1, 1000.0)
    share = _rank_share((0, 30), 2)  # each rank reads half of every layer and of the head
    assert 0.45 < share < 0.55
    assert found.step_ms == pytest.approx({1: 20 * share, 16: 100 * share, 64: 300 * share})
    assert found.prompt_ms == pytest.approx({256: 800 * share})
    stage = Calibration((found,), (), FrontCost(), HIDDEN).route().stages[0]
    assert stage.gates == 60 and stage.gate_link is not None
    gate_s = stage.gate_link.seconds(HIDDEN * 4)
    assert gate_s == pytest.approx(0.05e-3 + HIDDEN * 4 / 1e9)
    assert stage.step_s(1) == pytest.approx(20e-3 * share + 60 * gate_s, rel=1e-6)


def test_a_group_without_a_probed_node_is_refused_and_a_single_stage_has_no_gates() -> None:
    group = {"node_id": "a", "layers": [0, 30], "weight_bytes": 30_000_000, "ranks": ["a", "b"]}
    with pytest.raises(ValueError, match="probed node"):
        _stage_probe(group, status([group]), None)
    stage = (
        Calibration((_stage_probe(ONE_NODE, status([ONE_NODE]), None),), (), FrontCost(), HIDDEN)
        .route()
        .stages[0]
    )
    assert (
        stage.gates == 0
        and stage.step_s(1) == pytest.approx(20e-3)
        and stage.step_s(64) == pytest.approx(0.3)
    )


def test_a_group_that_probed_itself_steps_as_probed_and_every_step_carries_its_measured_overhead() -> (
    None
):
    """A group's leader probes steps run through the whole group: its gates are in them."""
    group = {
        "node_id": "a",
        "layers": [0, 30],
        "weight_bytes": 30_000_000,
        "ranks": ["a", "b"],
        "step_probe_ms": {"1": 12.0, "16": 60.0, "64": 200.0},
        "prompt_probe_ms": {"256": 500.0},
        "step_overhead_ms": {"1": 0.5, "16": 2.0},
    }
    link = {"nodes": ["a", "b"], "rtt_ms": 0.1, "bandwidth_mb_s": 1000.0}
    found = _stage_probe(group, status([group], [link]), None)
    assert found.node_id == "a+b" and found.ranks == 2 and found.gate_link_ms_mb_s is None
    stage = Calibration((found,), (), FrontCost(), HIDDEN).route().stages[0]
    assert stage.gates == 0
    assert stage.step_s(1) == pytest.approx(12.5e-3) and stage.step_s(16) == pytest.approx(62e-3)
    assert stage.step_s(64) == pytest.approx(206.8e-3)  # on the line: 0.1 ms more a row
    assert stage.step_s(0) == 0.0


def test_the_gain_two_stages_can_reach_is_one_nodes_step_of_64_rows_over_its_step_of_32() -> None:
    from seamline_bench.scale import _gain_bound

    node = ONE_NODE | {"step_probe_ms": {"1": 20.0, "16": 100.0, "32": 200.0, "64": 300.0}}
    calibration = Calibration((_stage_probe(node, status([node]), None),), (), FrontCost(), HIDDEN)
    assert (
        _gain_bound(calibration) == 1.5
    )  # 64 rows in 300 ms on one node; 2 x 32 rows in 2 x 100 ms on two
    assert _gain_bound(None) is None


def test_one_streams_hops_replace_the_pings_round_trip_where_the_data_path_is_slower() -> None:
    from seamline_bench.scale_calibration import data_path_hop_ms

    first, last = (
        dict(ONE_NODE, node_id="a", ring_ms=9.0),
        dict(ONE_NODE, node_id="b", cycle_ms=7.0),
    )
    assert data_path_hop_ms(status([first, last])) == pytest.approx(
        1.0
    )  # (9 - 7) ms over the ring's two hops
    assert data_path_hop_ms(status([dict(first, ring_ms=5.0), last])) == 0.0
    assert data_path_hop_ms(status([ONE_NODE, last])) is None  # no stream ran alone
    assert data_path_hop_ms(status([first])) is None


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to pin two nodes apart")
def test_the_front_goes_to_the_stage_whose_node_shares_the_load_generators_core() -> None:
    """Real processes, each with a node's --node-id and pinned to one core, as a bench mesh runs
    them: the stage on the clients' core takes the front, whatever its place in the plan."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(sleeper)] + [
        subprocess.Popen([*sleeper, "--node-id", f"m{i}"]) for i in range(2)
    ]
    try:
        for core, proc in enumerate(procs[1:]):
            psutil.Process(proc.pid).cpu_affinity([core])
            _wait_for_args(
                proc.pid, f"m{core}"
            )  # a process just started can read its parent's args
        server = Server("m", "http://127.0.0.1:1/v1", "default", [], procs, client_cores="0")
        assert node_beside_front(server, ["m1", "m0"]) == "m0"
        assert (
            node_beside_front(server, ["m0+m1"]) == "m0+m1"
        )  # a lockstep group: its leader's core
        server.client_cores = "1"
        assert node_beside_front(server, ["m0", "m1"]) == "m1"
        assert node_beside_front(server, ["elsewhere"]) is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_calibration_prices_the_front_on_its_stage() -> None:
    """The same probes and front, the front named on the last stage: one stream's tokens come
    sooner (its work overlaps stage 0's step) and the last stage's busy share counts it."""
    probe = _stage_probe(ONE_NODE, status([ONE_NODE]), None)
    first = StageProbe("a", (0, 15), 30_000_000, probe.step_ms, probe.prompt_ms)
    last = StageProbe("b", (15, 30), 30_000_000, probe.step_ms, probe.prompt_ms)
    links = ((0.2, 900.0), (0.2, 900.0))
    front = FrontCost(s_per_token=0.004)
    on_first = predict(Calibration((first, last), links, front, HIDDEN), 1, 16, (32,))
    on_last = predict(
        Calibration((first, last), links, front, HIDDEN, front_node="b"), 1, 16, (32,)
    )
    assert on_last["itl_ms"] < on_first["itl_ms"]
    assert on_last["busy"][1] > on_first["busy"][1] and on_last["busy"][0] < on_first["busy"][0]


def _wait_for_args(pid: int, node_id: str, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while node_id not in psutil.Process(pid).cmdline() and time.monotonic() < deadline:
        time.sleep(0.01)
