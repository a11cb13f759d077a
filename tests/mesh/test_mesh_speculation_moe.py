"""Speculative windows across a 2-stage mesh of a random Mixtral (routed experts on both
stages): the answers (64 tokens: greedy, seeded, and with penalties) must be those of the same
mesh with ``--speculative off``; n-gram drafts must have been accepted and rejected both."""

from __future__ import annotations

from pathlib import Path

from tests.support.mesh import speculation_answers
from tests.support.moe_folder import CONTEXT, build_moe_folder


def test_a_mixtral_mesh_that_speculates_answers_as_one_that_does_not(tmp_path: Path) -> None:
    """Narrow (16 wide) with attention that speaks softly: greedy answers fall into loops that
    the context bends now and then, so n-gram drafts are accepted and rejected both."""
    folder = build_moe_folder(tmp_path / "moe", attention_scale=0.4, hidden_size=16)
    plain, none = speculation_answers(
        tmp_path / "off", "--speculative", "off", model=folder, context=CONTEXT
    )
    drafted, counts = speculation_answers(
        tmp_path / "auto", model=folder, context=CONTEXT
    )  # the default
    assert not none
    assert drafted == plain
    assert counts["windows"] > 0 and 0 < counts["accepted"] < counts["drafted"], counts
