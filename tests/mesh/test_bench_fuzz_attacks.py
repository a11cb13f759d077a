"""`bench fuzz`'s attacks: the accounting on answers whose times are known, and two cheap attacks
run end to end (attacker in its own process) against a real 3-node mesh serving 8 clients, with
the attack and the watch after it cut to a few seconds and short answers."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from seamline_bench import attack_session
from seamline_bench.attack_metrics import AttackWindow, mesh_down_s, window_metrics
from seamline_bench.attacks import bench_attacks
from seamline_bench.chaos import ClientAnswer

FIGURES = {
    "mesh_down_s",
    "requests",
    "requests_lost",
    "wrong_answers",
    "near_tie_flips",
    "processes_exited",
    "attack",
}


def _answer(
    client: int, began: float, times: list[float], text: str = "a", error: str = ""
) -> ClientAnswer:
    return ClientAnswer(
        client,
        began,
        ended=(times[-1] if times else began) + 0.01,
        text=text,
        error=error,
        token_times=times,
    )


def test_the_mesh_is_down_for_the_longest_stretch_without_a_token_to_anyone() -> None:
    answers = [_answer(0, 0.0, [1.0, 2.0, 9.0]), _answer(1, 0.0, [3.0, 3.5])]
    assert mesh_down_s(answers, AttackWindow(1.5, 10.0)) == 5.5  # 3.5 -> 9.0
    assert (
        mesh_down_s(answers, AttackWindow(9.5, 12.0)) == 2.5
    )  # no token at all after 9.0: to the window's end
    calm = {0: "calm0", 1: "calm1"}
    taken = [
        _answer(0, 5.0, [5.5], "calm0"),
        _answer(1, 5.0, [5.5], "other"),
        _answer(0, 6.0, [], "", "boom"),
        _answer(1, 20.0, [20.5], "other"),
    ]  # the last one after the window: not counted
    figures, differ = window_metrics(taken, AttackWindow(4.0, 10.0), calm)
    assert (figures["requests"], figures["requests_lost"], len(differ)) == (3, 1, 1)


def test_two_attacks_on_a_live_mesh_are_refused_and_cost_its_clients_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        tempfile, "tempdir", str(tmp_path)
    )  # the bench keeps its work folder (its logs)
    monkeypatch.setattr(attack_session, "TOKENS", 12)
    monkeypatch.setattr(attack_session, "CALM_MIN_S", 2.0)
    result: dict[str, Any] = bench_attacks(
        duration_s=4.0, after_s=3.0, attacks=("oversize_logit_bias", "admin_body")
    )
    assert set(result) == {"oversize_logit_bias", "admin_body"}
    for name, figures in result.items():
        assert FIGURES <= set(figures), (name, figures)
        assert figures["attack"]["refused"], (name, figures["attack"])
        assert figures["attack"]["requests"] > 0
        assert figures["processes_exited"] == 0 and figures["requests_lost"] == 0, (name, figures)
        assert figures["wrong_answers"] == 0 and figures["mesh_down_s"] <= 10, (name, figures)
        assert "detected_s" not in figures and figures["targets_met"]  # no lying member in these
    assert set(result["oversize_logit_bias"]["attack"]["statuses"]) == {"400"}
    assert set(result["admin_body"]["attack"]["statuses"]) == {"401"}
