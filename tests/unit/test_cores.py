"""Nodes on one machine share its CPUs: each is planned at its measured rate times its share."""

from __future__ import annotations

import pytest

from seamline.mesh.plan.cores import Placement, core_shares

HOST = "boot-1"


def _shares(*placements: tuple[str, str, set[int], str]) -> dict[str, float]:
    return core_shares(Placement(n, h, frozenset(c), d) for n, h, c, d in placements)


def test_nodes_pinned_to_one_core_halve_it_and_a_node_on_another_core_has_it_whole() -> None:
    assert _shares(("a", HOST, {0}, "cpu"), ("b", HOST, {0}, "cpu"), ("c", HOST, {1}, "cpu")) == {
        "a": 0.5,
        "b": 0.5,
        "c": 1.0,
    }


def test_three_unpinned_nodes_on_two_cores_have_a_third_each() -> None:
    shares = _shares(*((n, HOST, {0, 1}, "cpu") for n in "abc"))
    assert shares == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})


def test_a_partly_shared_set_counts_each_cpu_apart() -> None:
    assert _shares(("a", HOST, {0, 1}, "cpu"), ("b", HOST, {1}, "cpu")) == {"a": 0.75, "b": 0.5}


def test_other_machines_accelerators_and_unknown_placements_share_nothing() -> None:
    shares = _shares(
        ("a", HOST, {0}, "cpu"),
        ("b", "boot-2", {0}, "cpu"),
        ("g", HOST, {0}, "cuda"),
        ("u", "", {0}, "cpu"),
        ("v", HOST, set(), "cpu"),
    )
    assert shares == {"a": 1.0, "b": 1.0, "g": 1.0, "u": 1.0, "v": 1.0}


def test_an_address_takes_a_machine_of_its_own_away_and_never_grants_one() -> None:
    """A node that names a machine of its own, its link coming from the honest nodes' address,
    shares their CPUs; nodes naming one machine from two addresses (two containers) still share."""

    def shares(*placed: tuple[str, str, str]) -> dict[str, float]:
        return core_shares(Placement(n, h, frozenset({0, 1}), "cpu", a) for n, h, a in placed)

    honest = (("a", HOST, "127.0.0.1"), ("b", HOST, "127.0.0.1"))
    assert shares(*honest, ("liar", "its-own", "127.0.0.1")) == pytest.approx(
        {"a": 1 / 3, "b": 1 / 3, "liar": 1 / 3}
    )
    assert shares(*honest, ("liar", "", "127.0.0.1"))["liar"] == pytest.approx(1 / 3)
    assert shares(("a", HOST, "10.0.0.1"), ("b", HOST, "10.0.0.2")) == {"a": 0.5, "b": 0.5}
    assert shares(*honest, ("far", "boot-2", "10.0.0.9"))["far"] == 1.0
