"""The links the coordinator plans with: each pair as its nodes measured it, else from the two
nodes' links to the coordinator (summed when relayed), and the plan that follows."""

from __future__ import annotations

from seamline.mesh.plan.planner import plan
from seamline.mesh.plan.types import LinkCost
from seamline.mesh.protocol.link_probe import Reach, link_table
from tests.support.planner import EXACT, MIB, node, spec


def test_the_coordinator_plans_a_pair_as_its_nodes_measured_it() -> None:
    """Access links alone say a and b are close; the pair's own measurement (say, a relayed path)
    says otherwise, and the planner takes the pair's. A pair not measured falls back to the
    access links, summed when one end takes no inbound connection."""
    near = LinkCost(0.0001, 1e9)
    reaches = [Reach("a", True, near), Reach("b", True, near), Reach("c", False, near)]
    table = link_table(reaches, {("b", "a"): LinkCost(0.2, 1e6)})
    assert table.between("a", "b") == LinkCost(0.2, 1e6)
    assert table.between("a", "c") == LinkCost(
        0.0002, 1e9
    )  # relayed, not measured: through the coordinator
    model = spec(20)
    nodes = [node("a", 12 * 100 * MIB), node("b", 12 * 100 * MIB), node("c", 12 * 100 * MIB)]
    assert set(plan(model, nodes, table, EXACT).node_ids()) != {"a", "b"}
    assert set(plan(model, nodes, link_table(reaches), EXACT).node_ids()) == {"a", "b"}
