"""The scale curve (``sim/curve.py``) on a few small pools of DGX Sparks running DeepSeek-V4-Flash."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from seamline.mesh.plan.groups import plan_auto  # noqa: E402
from seamline.mesh.plan.types import LinkTable  # noqa: E402
from seamline.sim import curve  # noqa: E402
from seamline.sim import published as ref  # noqa: E402
from seamline.sim.costs import Load  # noqa: E402
from seamline.sim.prediction import route_of  # noqa: E402

V4 = "DeepSeek-V4-Flash"
LOAD = Load(64, curve.PROMPT_TOKENS, 32)  # fewer output tokens than the curve's: a quick wave


@pytest.fixture(scope="module")
def points() -> list[curve.Point]:
    return curve.curve([V4], (4, 8), curve.LINKS, curve.CLIENTS, LOAD)


def _at(points: list[curve.Point], nodes: int, link: str, clients: int) -> curve.Point:
    (point,) = [p for p in points if (p.nodes, p.link, p.clients) == (nodes, link, clients)]
    return point


def test_points_are_finite_and_positive(points: list[curve.Point]) -> None:
    assert len(points) == 2 * len(curve.LINKS) * len(curve.CLIENTS)
    for p in points:
        assert p.fits and p.stages == p.nodes == p.nodes_used and sum(p.layers) == 43, p
        for value in (p.tok_s, p.ms_between_tokens, p.ttft_s, p.bound_tok_s):
            assert math.isfinite(value) and value > 0, p


def test_a_wan_is_slower_than_gigabit_ethernet_for_one_client(points: list[curve.Point]) -> None:
    for nodes in (4, 8):
        lan, wan = _at(points, nodes, "1 GbE", 1), _at(points, nodes, "20 ms WAN", 1)
        assert wan.tok_s < lan.tok_s and wan.ms_between_tokens > lan.ms_between_tokens


def test_many_clients_give_more_tokens_per_second(points: list[curve.Point]) -> None:
    for p in points:
        if p.clients == 1:
            assert _at(points, p.nodes, p.link, 64).tok_s > p.tok_s


def test_a_pool_too_small_does_not_fit() -> None:
    (point,) = curve.curve(["DeepSeek-V3 671B Q4_K_M"], (2,), {"1 GbE": ref.LINK_1GBE}, (1,), LOAD)
    assert not point.fits and point.note == "does not fit" and math.isnan(point.tok_s)
    assert "does not fit" in curve.markdown([point], ["1 GbE"], (1,))


def test_routed_experts_make_a_batched_step_read_more() -> None:
    model = curve.load_model(V4)
    pool = model.pool_of(4)
    links = LinkTable(default=ref.LINK_1GBE)
    plan = plan_auto(
        model.spec, pool, links, curve.plan_options(curve.CLIENTS, LOAD), model.checkpoint.config
    )
    plain = route_of(plan, model.spec, pool, links)
    routed = curve.with_routed_experts(plain, plan, model.spec, model.checkpoint.config)
    for before, after in zip(plain.stages, routed.stages):
        assert after.step_s(1) == pytest.approx(
            before.step_s(1)
        )  # one row reads its own experts either way
        assert after.step_s(16) > before.step_s(16)


def test_table_and_json(points: list[curve.Point], tmp_path: Path) -> None:
    table = curve.markdown(points, list(curve.LINKS), curve.CLIENTS)
    assert table.count("\n") == 3 and "| DeepSeek-V4-Flash | 8 | 8 (0) |" in table
    data = json.loads(curve.to_json(points, LOAD, curve.CLIENTS, 1.0))
    assert len(data["points"]) == len(points) and data["node_counts"] == [4, 8]
    assert any("DGX Spark" in line for line in data["assumptions"])
