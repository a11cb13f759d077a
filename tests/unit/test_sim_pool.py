"""The simulator over a pool file: the file's simulator fields and their refusals, a plan priced
as the simulator sees it, a slow member, and `seamline plan --simulate` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from seamline.mesh.control.plan_cli import run_plan_command
from seamline.mesh.control.pool_file import parse_pool, read_pool
from seamline.mesh.plan.planner import plan, price_route
from seamline.mesh.plan.types import (
    DeviceInfo,
    LinkTable,
    ModelSpec,
    NodeInfo,
    Plan,
    PlanError,
    PlanOptions,
)
from seamline.sim.costs import DeviceSpeed
from seamline.sim.prediction import combined_speed, stage_costs
from tests.support.planner import MIB

REPO = Path(__file__).resolve().parents[2]
THROUGHPUT = PlanOptions(context_tokens=64, batch=1, headroom_fraction=0.0, headroom_bytes=0)
FAST = {"16": 1.2e11, "64": 3.2e11}  # weight bytes x rows per second at 16 and 64 rows


def _node(node_id: str, **extra: Any) -> dict[str, Any]:
    return {"node_id": node_id, "free_memory_gb": 1, "bytes_per_second": 1e10, **extra}


@pytest.mark.parametrize(
    ("pool", "said"),
    [
        ([_node("a", speed=2)], "node 0 has unknown field 'speed'"),
        (
            [
                _node(
                    "a",
                    devices=[
                        {
                            "device": "cuda:0",
                            "free_memory_gb": 1,
                            "bytes_per_second": 1e11,
                            "fast": 1,
                        }
                    ],
                )
            ],
            "node 0 (a): device 0 has unknown field 'fast'",
        ),
        (
            [_node("a", free_memory_gb=-1)],
            "needs free_memory_gb as a non-negative finite number, not -1",
        ),
        (
            [
                _node(
                    "a",
                    devices=[
                        {"device": "cuda:0", "free_memory_bytes": -5, "bytes_per_second": 1e11}
                    ],
                )
            ],
            "device cuda:0 needs free_memory_bytes as a non-negative finite number, not -5",
        ),
        ([_node("a", fails_at_s=-2)], "needs fails_at_s as a non-negative finite number, not -2"),
        (
            [_node("a", batched_bytes_per_second={"sixteen": 1e11})],
            "needs each batched_bytes_per_second key to be a row count (a positive integer such as \"16\"), not 'sixteen'",
        ),
        (
            [_node("a", batched_bytes_per_second={"0": 1e11})],
            "batched_bytes_per_second key to be a row count",
        ),
        (
            [_node("a", batched_bytes_per_second={"16": 0})],
            "batched_bytes_per_second needs 16 > 0, not 0.0",
        ),
        (
            [_node("a", batched_bytes_per_second=[16, 1e11])],
            "needs batched_bytes_per_second as an object",
        ),
        (
            {"nodes": [_node("a"), _node("b")], "links": [{"a": "a", "b": "x"}]},
            "link 0 names node 'x', which the pool does not declare (a, b)",
        ),
    ],
)
def test_a_bad_pool_file_is_refused_in_one_line_naming_the_field(
    tmp_path: Path, pool: Any, said: str
) -> None:
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(pool))
    with pytest.raises(PlanError) as err:
        read_pool(str(path))
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_simulator_fields_ride_on_the_nodes_and_the_plan_json_is_unchanged() -> None:
    gpu = {
        "device": "cuda:0",
        "free_memory_gb": 2,
        "bytes_per_second": 1e12,
        "batched_bytes_per_second": {"64": 9e12},
    }
    nodes, links = parse_pool(
        {
            "nodes": [
                _node("a", batched_bytes_per_second=FAST, fails_at_s=3.5, devices=[gpu]),
                _node("b"),
            ]
        },
        strict_links=True,
    )
    a, b = nodes
    assert a.batched_bytes_per_second == ((16, 1.2e11), (64, 3.2e11)) and a.fails_at_s == 3.5
    assert a.devices == (DeviceInfo("cuda:0", 2 << 30, 1e12, ((64, 9e12),)),)
    assert b.batched_bytes_per_second == () and b.fails_at_s is None
    model = ModelSpec("m", 4, 64, (100 * MIB,) * 4, MIB, MIB, 64, 256)
    chosen = plan(model, nodes, links, THROUGHPUT)
    assert Plan.from_json(chosen.to_json()) == chosen
    assert "batched" not in chosen.to_json() and "fails_at_s" not in chosen.to_json()


def test_a_pool_too_small_says_how_short_it_is_and_which_node_would_cover_it() -> None:
    model = ModelSpec("m", 10, 64, (100 * MIB,) * 10, 10 * MIB, 10 * MIB, 1024, 256)
    nodes = [NodeInfo("a", 300 * MIB, 1e10), NodeInfo("b", 900 * MIB, 1e10)]
    with pytest.raises(PlanError) as err:
        plan(model, nodes, None, PlanOptions(context_tokens=64))
    text = str(err.value)
    assert "\n" not in text and "cannot hold" in text, (
        text
    )  # the planner's refusal, numbers in bytes kept
    assert (
        "the pool holds 0.7 GiB after headroom and the model needs 1.0 GiB: 0.3 GiB short; "
        "one more node like 'b' (0.9 GiB free) would cover it"
    ) in text, text
    smaller = [
        NodeInfo("a", 600 * MIB, 1e10),
        NodeInfo("d", 500 * MIB, 1e10),
    ]  # neither covers the 0.4 GiB
    with pytest.raises(
        PlanError, match=r"0\.4 GiB short; 2 more nodes like 'a' \(0\.6 GiB free each\) would"
    ):
        plan(model, smaller, None, PlanOptions(context_tokens=64))


def test_a_stage_split_over_its_gpu_and_cpu_steps_as_both_parts_one_after_the_other() -> None:
    gpu, cpu = DeviceSpeed(1e12, {16: 1e13, 64: 3e13}), DeviceSpeed(1e10, {16: 5e10})
    both = combined_speed([(3e8, gpu), (1e8, cpu)])
    for rows in (1, 16, 64):
        assert both.step_s(4e8, rows) == pytest.approx(
            gpu.step_s(3e8, rows) + cpu.step_s(1e8, rows)
        )
    model = ModelSpec("m", 4, 64, (100 * MIB,) * 4, MIB, MIB, 64, 256)
    node = NodeInfo("a", 1 << 30, 1e10, devices=(DeviceInfo("cuda:0", 250 * MIB, 1e12),))
    chosen = plan(model, [node], None, THROUGHPUT)
    assert chosen.stages[0].gpu_layers == 2  # two layers on its GPU, two with the head on its CPU
    (stage,) = stage_costs(chosen, model, [node], LinkTable())
    assert stage.step_s(1) == pytest.approx(
        chosen.stages[0].compute_s
    )  # one row: the planner's time


def _slow_pool() -> tuple[ModelSpec, list[NodeInfo]]:
    """12 layers; a and b hold 5 each with the embedding or the head, so slow (a tenth of their
    speed) must hold the 2 between."""
    model = ModelSpec("m", 12, 256, (100 * MIB,) * 12, 10 * MIB, 10 * MIB, 1024, 1024)
    fast = tuple((int(k), v) for k, v in FAST.items())
    slow_batched = tuple((rows, rate / 10) for rows, rate in fast)
    return model, [
        NodeInfo("a", 520 * MIB, 1e10, batched_bytes_per_second=fast),
        NodeInfo("b", 520 * MIB, 1e10, batched_bytes_per_second=fast),
        NodeInfo("slow", 600 * MIB, 1e9, batched_bytes_per_second=slow_batched),
    ]


def test_a_slow_member_is_routed_around_and_a_plan_leaning_on_it_is_predicted_slower() -> None:
    pytest.importorskip("simpy")
    from seamline.sim.prediction import predict

    model, nodes = _slow_pool()
    chosen = plan(model, nodes, None, THROUGHPUT)
    layers = {s.node_id: s.end - s.start for s in chosen.stages}
    assert layers.get("slow", 0) < 4, chosen  # the fewest it can take, not an even share
    even = price_route(model, nodes, None, THROUGHPUT, [("a", 0, 4), ("slow", 4, 8), ("b", 8, 12)])
    ahead = predict(chosen, model, nodes, None, 16, 16, 16)
    behind = predict(even, model, nodes, None, 16, 16, 16)
    for prediction in (ahead, behind):
        assert prediction["bottleneck"] == "slow", prediction  # its busy fraction the largest
        busy = dict(zip(prediction["stages"], prediction["busy"]))
        assert busy["slow"] > 2 * max(busy["a"], busy["b"]), prediction
    assert ahead["tok_s"] > 1.3 * behind["tok_s"], (ahead, behind)
    assert ahead["single_ms_per_token"] < behind["single_ms_per_token"]
    roomy = [n if n.node_id == "slow" else NodeInfo(n.node_id, 800 * MIB, 1e10) for n in nodes]
    assert "slow" not in plan(model, roomy, None, THROUGHPUT).node_ids()  # room elsewhere: left out


def test_seamline_plan_prints_predictions_or_how_to_get_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("simpy")
    from seamline.sim import report

    pool = [
        {
            "node_id": x,
            "free_memory_gb": 0.4,
            "bytes_per_second": 2e10,
            "batched_bytes_per_second": FAST,
        }
        for x in "ab"
    ]
    (tmp_path / "pool.json").write_text(json.dumps(pool))
    sim = report.SimOptions(clients=(1, 4), prompt_tokens=8, output_tokens=8)
    assert run_plan_command(str(tmp_path / "pool.json"), None, None, 256, 1, sim=sim) == 0
    out = capsys.readouterr().out
    assert "ms/token (network" in out and "predicted under load" in out, (
        out
    )  # the planner's line stays
    rows = [
        line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["1"], ["4"]) and "%" in line
    ]
    assert [r[0] for r in rows] == ["1", "4"] and "no batched_bytes_per_second" not in out, out
    monkeypatch.setattr(report, "simulator_missing", lambda: report.INSTALL_HINT)
    assert run_plan_command(str(tmp_path / "pool.json"), None, None, 256, 1, sim=sim) == 0
    assert "pip install 'seamline[sim]'" in capsys.readouterr().out


def test_seamline_plan_simulate_writes_the_table_and_the_plot(tmp_path: Path) -> None:
    """The embedded model over the pool's first n nodes: one node cannot hold it, two can until b
    fails (then nothing fits), three replan around b when it fails."""
    pytest.importorskip("simpy")
    pytest.importorskip("matplotlib")
    pool = [
        {
            "node_id": "a",
            "free_memory_gb": 0.3,
            "bytes_per_second": 2e10,
            "batched_bytes_per_second": FAST,
        },
        {"node_id": "b", "free_memory_gb": 0.36, "bytes_per_second": 2e10, "fails_at_s": 0.05},
        {"node_id": "c", "free_memory_gb": 0.36, "bytes_per_second": 2e9},
    ]
    (tmp_path / "pool.json").write_text(json.dumps(pool))
    plot = tmp_path / "sweep.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "seamline.cli",
            "plan",
            "--nodes",
            str(tmp_path / "pool.json"),
            "--context",
            "256",
            "--simulate",
            "--plot",
            str(plot),
            "--clients",
            "1,4",
            "--prompt-tokens",
            "8",
            "--output-tokens",
            "8",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = done.stdout.splitlines()
    header = next(
        i for i, line in enumerate(lines) if line.split()[:3] == ["nodes", "clients", "tok/s"]
    )
    rows = [
        line.split() for line in lines[header + 1 :] if line.split() and line.split()[0].isdigit()
    ]
    assert rows[0][0] == "1" and "no plan fits" in " ".join(rows[0]), done.stdout
    assert [r[:2] for r in rows[1:]] == [["2", "1"], ["2", "4"], ["3", "1"], ["3", "4"]], (
        done.stdout
    )
    assert all("b fails at 0.05 s" in " ".join(r) for r in rows[1:]), done.stdout
    assert "no plan fits the rest" in " ".join(rows[1]) and "replanned onto" in " ".join(rows[3]), (
        done.stdout
    )
    assert int(rows[4][6]) >= 1, done.stdout  # the 4 clients' requests replayed after b failed
    assert f"plot written to {plot}" in done.stdout
