"""Speculative windows across a 2-stage mesh, in real node processes over real sockets: stage 0
drafts, the window's rows cross the link as one row flagged WINDOW, the last stage draws after
each while the drafts are accepted, and the next row goes on from the first rejected position
(every later stage rewinds to it). The answers (64 tokens: greedy, seeded, and with a frequency
penalty, which counts the tokens a later stage read from the frames) must be those of the same
mesh with ``--speculative off``; drafts must have been accepted and rejected both."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.mesh import start_mesh
from tests.support.v4_folder import CONTEXT, build_v4_folder

LIST = [{"role": "user", "content": "Repeat this list exactly, twice: apples, pears, plums, cherries, figs, dates."}]
ASKS = [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}, {"temperature": 0, "frequency_penalty": 1.0, "presence_penalty": 0.5}]


def _answers(root: Path, *serve_args: str, stages: int = 2, model: Path | None = None) -> tuple[list[str], dict[str, float]]:
    mesh = start_mesh(root, stages, *serve_args, model=model, context=CONTEXT)
    try:
        assert len(mesh.wait_ready()["stages"]) == stages
        answers = []
        for ask in ASKS:
            body = {"model": "default", "messages": LIST, "max_tokens": 64, "ignore_eos": True, **ask}
            reply = httpx.post(f"{mesh.base_url}/v1/chat/completions", json=body, timeout=120).json()
            assert reply["usage"]["completion_tokens"] == 64, reply
            answers.append(reply["choices"][0]["message"]["content"])
        status = httpx.get(f"{mesh.base_url}/api/status", timeout=30).json()
    finally:
        mesh.stop()
    return answers, status["stages"][0].get("speculation") or {}


def test_a_mesh_that_speculates_answers_as_one_that_does_not(tmp_path: Path) -> None:
    plain, none = _answers(tmp_path / "off", "--speculative", "off")
    drafted, counts = _answers(tmp_path / "auto")  # the default
    assert not none
    assert drafted == plain
    assert counts["windows"] > 0 and 0 < counts["accepted"] < counts["drafted"], counts


def test_windows_in_flight_across_three_stages_change_no_answer(tmp_path: Path) -> None:
    """Three stages: stage 0 keeps windows in flight behind one another (``follows``)."""
    plain, _ = _answers(tmp_path / "off", "--speculative", "off", stages=3)
    drafted, counts = _answers(tmp_path / "auto", stages=3)
    assert drafted == plain
    assert counts["follows"] > 0 and 0 < counts["accepted"] < counts["drafted"], counts
    assert 0 <= counts["stale"] <= counts["follows"], counts


def test_a_deepseek_v4_mesh_that_speculates_answers_as_one_that_does_not(tmp_path: Path) -> None:
    """DeepSeek-V4's caches forget what leaves their window: each stage's takes a window's
    rejected positions back at the next step (a random 4-layer checkpoint whose attention
    speaks softly: its greedy answers loop, so n-grams draft)."""
    folder = build_v4_folder(tmp_path / "v4", attention_scale=0.05)
    plain, _ = _answers(tmp_path / "off", "--speculative", "off", model=folder)
    drafted, counts = _answers(tmp_path / "auto", model=folder)
    assert drafted == plain
    assert counts["windows"] > 0 and 0 < counts["accepted"] < counts["drafted"], counts
