"""The planner over CPU and GPU nodes: a stage's first layers on its node's GPU as far as they
fit, the rest on its CPU (``plan.split``); the pool file and ``seamline plan`` with devices."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from seamline.mesh.control.plan_cli import format_plan, parse_pool, run_plan_command
from seamline.mesh.node import membership
from seamline.mesh.plan.planner import _model_tables, plan, price_route
from seamline.mesh.plan.pricing import range_bytes
from seamline.mesh.plan.split import capacities, split_band, split_stage
from seamline.mesh.plan.types import (
    DeviceInfo,
    LinkCost,
    LinkTable,
    ModelSpec,
    NodeInfo,
    Plan,
    PlanError,
    PlanOptions,
)
from seamline.net.messages import Assign, Resources
from tests.support.planner import EXACT, MIB, node, spec

GIB = 1 << 30


def gpu_node(node_id: str, free: int, rate: float, gpu_free: int, gpu_rate: float) -> NodeInfo:
    return NodeInfo(node_id, free, rate, devices=(DeviceInfo("cuda:0", gpu_free, gpu_rate),))


def assert_fits(p: Plan, model: ModelSpec, nodes: list[NodeInfo], options: PlanOptions) -> None:
    """Every stage within its GPU's memory and its system memory, and priced as its route."""
    by_id = {n.node_id: n for n in nodes}
    for s in p.stages:
        cpu, gpu = capacities(by_id[s.node_id], options)
        assert s.gpu_bytes <= gpu and s.predicted_bytes - s.gpu_bytes <= cpu, s
        assert split_stage(
            model,
            options,
            by_id[s.node_id],
            s.start,
            s.end,
            range_bytes(model, options, s.start, s.end),
        ).fits
    assert (
        price_route(
            model, nodes, None, options, [(s.node_id, s.start, s.end) for s in p.stages]
        ).stages
        == p.stages
    )


def test_a_fast_gpu_node_gets_more_layers_than_cpu_nodes() -> None:
    model = spec(24, embed=50 * MIB, head=50 * MIB, kv=256)
    nodes = [
        node("c1", 4 * GIB, 1e10),
        node("c2", 4 * GIB, 1e10),
        gpu_node("g", GIB, 1e10, 2 * GIB, 1e11),
    ]
    for objective in ("throughput", "latency"):
        options = replace(EXACT, objective=objective)
        p = plan(model, nodes, None, options)
        sizes = {s.node_id: s.end - s.start for s in p.stages}
        assert sizes["g"] > max(v for k, v in sizes.items() if k != "g"), sizes
        g = next(s for s in p.stages if s.node_id == "g")
        count = g.end - g.start
        on_gpu = count if g.gpu_layers is None else g.gpu_layers
        assert (
            g.gpu_device == "cuda:0" and on_gpu >= count - 2
        )  # (a layer or two on its CPU evens the stages)
        head = 50 * MIB if g.owns_head and g.gpu_layers is not None else 0  # on the CPU in a split
        on_cpu = (count - on_gpu) * 100 * MIB + head
        gpu_head = 50 * MIB if g.owns_head and g.gpu_layers is None else 0
        assert g.compute_s == pytest.approx((on_gpu * 100 * MIB + gpu_head) / 1e11 + on_cpu / 1e10)
        assert all(
            s.gpu_device == "" and s.gpu_layers is None for s in p.stages if s.node_id != "g"
        )
        assert_fits(p, model, nodes, options)


def test_a_node_spans_its_gpu_and_its_cpu_when_its_gpu_is_too_small() -> None:
    model = spec(30, embed=50 * MIB, head=80 * MIB, kv=1024)  # a layer: 100 MiB + 4 MiB of KV cache
    spark = gpu_node("spark", 100 * GIB, 2e10, GIB, 1e12)
    p = plan(model, [spark], None, EXACT)
    (s,) = p.stages
    per_layer = 100 * MIB + 1024 * EXACT.context_tokens
    fitting = (GIB - 50 * MIB) // per_layer  # with the embedding
    assert s.gpu_device == "cuda:0" and s.gpu_layers == fitting < 30
    assert s.gpu_bytes == 50 * MIB + fitting * per_layer
    assert s.predicted_bytes - s.gpu_bytes <= EXACT.capacity(
        spark.free_memory_bytes
    )  # the rest in system memory
    on_cpu = (30 - fitting) * 100 * MIB + 80 * MIB  # and the head, read on the CPU
    assert s.compute_s == pytest.approx(fitting * 100 * MIB / 1e12 + on_cpu / 2e10)
    assert s.device_ranges() == (("cuda:0", 0, fitting), ("cpu", fitting, 30))
    assert not p.notes
    assert_fits(p, model, [spark], EXACT)


def test_gpu_and_system_memory_together_hold_what_neither_does_alone() -> None:
    model = spec(30)  # 3000 MiB
    both = gpu_node("both", 2 * GIB, 1e10, 2 * GIB, 1e11)
    with pytest.raises(PlanError, match="cannot hold"):
        plan(model, [replace(both, devices=())], None, EXACT)
    (s,) = plan(model, [both], None, EXACT).stages
    assert s.gpu_layers == 20 and s.device_ranges() == (("cuda:0", 0, 20), ("cpu", 20, 30))


def test_a_gpu_too_small_for_one_layer_runs_the_stage_on_the_cpu_and_says_so() -> None:
    model = spec(12, layer=500 * MIB)
    small = gpu_node("small", 10 * GIB, 1e10, 300 * MIB, 1e12)
    p = plan(model, [small], None, EXACT)
    (s,) = p.stages
    assert s.gpu_layers == 0 and s.gpu_device == "cuda:0" and s.gpu_bytes == 0
    assert s.device_ranges() == (("cpu", 0, 12),)
    assert s.compute_s == pytest.approx(12 * 500 * MIB / 1e10)
    (line,) = p.notes
    assert "small" in line and "cuda:0" in line and "0.29 GiB free" in line and "0.49 GiB" in line
    assert "\n" not in line and line in format_plan(p, [small])
    assert Plan.from_json(p.to_json()) == p  # a lock keeps the split and the line


def test_a_pool_without_devices_plans_as_before() -> None:
    rng = random.Random(3)
    for _ in range(30):
        layers = rng.randint(1, 40)
        model = spec(
            layers, embed=rng.choice((0, 80)) * MIB, head=rng.choice((0, 120)) * MIB, kv=512
        )
        nodes = [
            node(f"n{i}", rng.randint(2, 30) * 100 * MIB, rng.uniform(1e9, 1e11))
            for i in range(rng.randint(1, 9))
        ]
        try:
            p = plan(model, nodes, None, EXACT)
        except PlanError:
            continue
        assert all(
            s.gpu_layers is None and s.gpu_device == "" and s.gpu_bytes == 0 for s in p.stages
        )
        assert not p.notes and "devices" not in format_plan(p, nodes)
        # a device list the node does not use changes nothing but the plan's record of where it ran
        read = [
            range_bytes(model, EXACT, s.start, s.end)[2]
            / {n.node_id: n for n in nodes}[s.node_id].bytes_per_second
            for s in p.stages
        ]
        assert [s.compute_s for s in p.stages] == read


def random_device_case(
    rng: random.Random, n: int, layers: int, objective: str
) -> tuple[ModelSpec, list[NodeInfo], PlanOptions]:
    layer_bytes = tuple(rng.choice((60, 100, 150)) * MIB for _ in range(layers))
    model = ModelSpec(
        "r",
        layers,
        1024,
        layer_bytes,
        rng.choice((0, 50, 200)) * MIB,
        rng.choice((10, 200)) * MIB,
        rng.choice((0, 256)),
        4096,
        rng.random() < 0.3,
        head_load_bytes=rng.choice((None, 20 * MIB)),
    )
    total = sum(layer_bytes)
    nodes = []
    for i in range(n):
        cpu = node(f"n{i:03d}", int(total * rng.uniform(0.1, 1.5)), rng.uniform(1e9, 5e10))
        if rng.random() < 0.5:
            cpu = replace(
                cpu,
                devices=(
                    DeviceInfo(
                        f"cuda:{i % 2}", int(total * rng.uniform(0.0, 1.2)), rng.uniform(1e10, 1e12)
                    ),
                ),
            )
        nodes.append(cpu)
    options = PlanOptions(
        context_tokens=rng.choice((128, 4096)),
        batch=rng.choice((1, 4)),
        headroom_fraction=0.05,
        headroom_bytes=8 * MIB,
        objective=objective,
    )
    return model, nodes, options


def every_plan(
    model: ModelSpec, nodes: list[NodeInfo], links: LinkTable, options: PlanOptions
) -> list[Plan]:
    """Every route whose stages fit on their nodes' devices, priced."""
    L, plans = model.num_layers, []
    for k in range(1, min(len(nodes), L) + 1):
        for chosen in itertools.permutations(nodes, k):
            for inner in itertools.combinations(range(1, L), k - 1):
                cuts = (0, *inner, L)
                route = [(x.node_id, cuts[i], cuts[i + 1]) for i, x in enumerate(chosen)]
                if all(
                    split_stage(model, options, x, s, e, range_bytes(model, options, s, e)).fits
                    for x, (_, s, e) in zip(chosen, route)
                ):
                    plans.append(price_route(model, nodes, links, options, route))
    return plans


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_small_mixed_pools_match_exhaustive_search(objective: str) -> None:
    rng = random.Random(17 if objective == "latency" else 18)
    compared = spanned = 0
    for _ in range(80):
        model, nodes, options = random_device_case(
            rng, rng.randint(1, 4), rng.randint(1, 5), objective
        )
        links = LinkTable(default=LinkCost(rng.choice((1e-4, 2e-2)), 1.25e8))
        plans = every_plan(model, nodes, links, options)
        if not plans:
            with pytest.raises(PlanError):
                plan(model, nodes, links, options)
            continue
        chosen = plan(model, nodes, links, options)
        if objective == "throughput":
            slowest = min(p.slowest_stage_s() for p in plans)
            assert chosen.slowest_stage_s() == pytest.approx(slowest, rel=1e-6)
            plans = [p for p in plans if p.slowest_stage_s() <= slowest * (1 + 1e-9)]
        assert chosen.predicted_s_per_token == pytest.approx(
            min(p.predicted_s_per_token for p in plans), rel=1e-5
        )
        compared += 1
        spanned += any(s.gpu_layers for s in chosen.stages)
    assert compared >= 30 and spanned >= 5


def test_large_mixed_pools_give_valid_plans() -> None:
    rng = random.Random(5)
    planned = 0
    for n in (6, 13, 40, 150, 400):
        for _ in range(3):
            model, nodes, options = random_device_case(rng, n, rng.randint(1, 96), "throughput")
            try:
                p = plan(model, nodes, None, options)
            except PlanError:
                continue
            assert_fits(p, model, nodes, options)
            planned += 1
    assert planned >= 10


def test_the_planner_band_agrees_with_one_stage_priced_alone() -> None:
    """``split_band`` (the DP's tables) and ``split_stage`` (``price_route``) place and time
    every range alike, to the last bit."""
    rng = random.Random(9)
    for _ in range(40):
        model, nodes, options = random_device_case(rng, 1, rng.randint(1, 20), "latency")
        x = replace(
            nodes[0],
            devices=(DeviceInfo("cuda:0", rng.randint(0, 3000) * MIB, rng.uniform(1e10, 1e12)),),
        )
        costs = _model_tables(model, options)
        cpu, gpu = capacities(x, options)
        L = model.num_layers
        fits, t, t_load = split_band(
            costs.held,
            costs.active,
            costs.embed,
            (costs.mem, costs.read, costs.load),
            (cpu, x.bytes_per_second),
            (gpu, x.devices[0].bytes_per_second),
        )
        for s, e in itertools.combinations(range(L + 1), 2):
            alone = split_stage(model, options, x, s, e, range_bytes(model, options, s, e))
            d = e - 1 - s
            assert (bool(fits[d, e]), float(t[d, e]), float(t_load[d, e])) == (
                alone.fits,
                alone.read_s,
                alone.load_s,
            )
        assert not fits[
            np.arange(L)[:, None] >= np.arange(L + 1)[None, :]
        ].any()  # ranges starting before 0


def test_the_pool_file_takes_devices_and_checks_them() -> None:
    nodes, _ = parse_pool(
        [
            {
                "node_id": "spark",
                "free_memory_bytes": 100e9,
                "bytes_per_second": 2e11,
                "devices": [
                    {"device": "cuda:0", "free_memory_bytes": 30e9, "bytes_per_second": 1.5e12}
                ],
            },
            {"node_id": "old", "free_memory_gb": 8, "bytes_per_second": 2e10},
        ]
    )
    assert (
        nodes[0].devices == (DeviceInfo("cuda:0", 30_000_000_000, 1.5e12),)
        and nodes[1].devices == ()
    )
    bad = [
        (
            [{"device": "cpu", "free_memory_gb": 1, "bytes_per_second": 1.0}],
            "device 0 needs a name",
        ),
        ([{"device": "cuda:0", "free_memory_gb": 1}], "bytes_per_second"),
        (
            [{"device": "cuda:0", "free_memory_gb": 1, "bytes_per_second": 1.0, "speed": 2}],
            "unknown field 'speed'",
        ),
        ([{"device": "cuda:0", "free_memory_gb": 1, "bytes_per_second": 1.0}] * 2, "listed once"),
        ({"device": "cuda:0"}, "must be a list"),
    ]
    for devices, message in bad:
        with pytest.raises(PlanError, match=message):
            parse_pool(
                [{"node_id": "a", "free_memory_gb": 1, "bytes_per_second": 1.0, "devices": devices}]
            )


def test_seamline_plan_prints_each_stage_device_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded model (30 layers) over a CPU node and a node whose small GPU holds part of its stage."""
    pool = [
        {"node_id": "cpu-box", "free_memory_gb": 0.36, "bytes_per_second": 2e10},
        {
            "node_id": "spark",
            "free_memory_gb": 0.32,
            "bytes_per_second": 1e10,
            "devices": [{"device": "cuda:0", "free_memory_gb": 0.3, "bytes_per_second": 1e11}],
        },
    ]
    nodes_file, lock = tmp_path / "nodes.json", tmp_path / "plan.lock.json"
    nodes_file.write_text(json.dumps(pool))
    assert run_plan_command(str(nodes_file), None, str(lock), 2048, 1) == 0
    out = capsys.readouterr().out
    pinned = Plan.from_json(lock.read_text())
    cpu_box, spark = (
        next(s for s in pinned.stages if s.node_id == x) for x in ("cpu-box", "spark")
    )
    assert spark.gpu_device == "cuda:0" and 0 < spark.gpu_layers < spark.end - spark.start  # type: ignore[operator]
    cut = spark.start + spark.gpu_layers  # type: ignore[operator]
    split = f"cuda:0 [{spark.start},{cut}) + cpu [{cut},{spark.end})"
    rows = {
        line.split()[1]: line for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])
    }
    assert "devices" in out and rows["spark"].endswith(split), out
    assert rows["cpu-box"].endswith(f"cpu [{cpu_box.start},{cpu_box.end})"), out
    assert (
        run_plan_command(str(nodes_file), None, str(lock), 2048, 1) == 0
    )  # the lock, checked on both memories
    assert split in capsys.readouterr().out


def test_messages_carry_devices_and_the_gpu_share_old_and_new() -> None:
    old = Resources.model_validate(
        {"free_memory_bytes": 1 << 30, "bytes_per_second": 1e10, "device": "cpu"}
    )
    assert old.devices == []
    new = Resources.model_validate(
        {
            "free_memory_bytes": 1 << 30,
            "bytes_per_second": 1e10,
            "device": "cuda",
            "devices": [
                {"device": "cuda:0", "free_memory_bytes": 1 << 34, "bytes_per_second": 3e12}
            ],
        }
    )
    assert new.devices[0].device == "cuda:0"
    for wrong in (
        {"device": "cuda:0\n", "free_memory_bytes": 1, "bytes_per_second": 1.0},
        {"device": "cuda:0", "free_memory_bytes": -1, "bytes_per_second": 1.0},
        {"device": "cuda:0", "free_memory_bytes": 1, "bytes_per_second": float("inf")},
    ):
        with pytest.raises(ValueError):
            Resources.model_validate(
                {"free_memory_bytes": 1, "bytes_per_second": 1.0, "devices": [wrong]}
            )
    fields = {
        "plan_id": 1,
        "model_hash": "h",
        "fragments_url": "u",
        "layers": (0, 4),
        "owns_embedding": True,
        "owns_head": False,
        "dtype": "float32",
        "context_length": 64,
    }
    assert Assign(**fields).gpu_layers is None
    assert (
        Assign.model_validate_json(Assign(**fields, gpu_layers=3).model_dump_json()).gpu_layers == 3
    )
    assert math.isfinite(new.devices[0].bytes_per_second)


def test_a_node_reports_its_cuda_devices_the_one_it_computes_on_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Options:
        device = "auto"
        max_memory_bytes: int | None = None

    if not torch.cuda.is_available():
        assert membership.local_devices(Options()) == []  # type: ignore[arg-type]  # a CPU machine: as before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: ((d.index + 1) << 30, 80 << 30))
    monkeypatch.setattr(membership, "measure_device_rate", lambda d, free: 1e12 + d.index)
    monkeypatch.setattr(membership, "resolve_device", lambda name: torch.device(name))
    Options.device = "cuda:1"
    got = membership.local_devices(Options())  # type: ignore[arg-type]
    assert [(d.device, d.free_memory_bytes, d.bytes_per_second) for d in got] == [
        ("cuda:1", 2 << 30, 1e12 + 1),
        ("cuda:0", 1 << 30, 1e12),
        ("cuda:2", 3 << 30, 1e12 + 2),
    ]
    Options.max_memory_bytes = 3 << 29  # --max-memory 1.5: caps what it offers on each GPU too
    got = membership.local_devices(Options())  # type: ignore[arg-type]
    assert [d.free_memory_bytes for d in got] == [3 << 29, 1 << 30, 3 << 29]
    Options.device = "cpu"  # told to compute on its CPU: planned on it alone
    assert membership.local_devices(Options()) == []  # type: ignore[arg-type]


def test_a_stage_held_with_another_gpu_split_is_not_kept() -> None:
    """A rejoining node's loaded stage is kept only for the same split over its GPU and CPU."""
    from seamline.net.messages import Holding

    base = dict(
        plan_id=1,
        model_hash="h",
        fragments_url="http://x",
        layers=(0, 4),
        owns_embedding=True,
        owns_head=False,
        dtype="bfloat16",
        context_length=512,
    )
    held = Holding.of(Assign(**base, gpu_layers=3))
    assert held == Holding.of(Assign(**base, gpu_layers=3))
    assert held != Holding.of(Assign(**base, gpu_layers=2))
    assert held != Holding.of(Assign(**base))  # now all on the node's own device
    assert Holding.model_validate_json(held.model_dump_json()) == held
