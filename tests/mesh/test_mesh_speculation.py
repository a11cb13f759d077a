"""Speculative windows across a 2-stage mesh, in real node processes over real sockets: stage 0
drafts, the window's rows cross the link as one row flagged WINDOW, the last stage draws after
each while the drafts are accepted, and the next row goes on from the first rejected position
(every later stage rewinds to it). The answers (64 tokens: greedy, seeded, and with a frequency
penalty, which counts the tokens a later stage read from the frames) must be those of the same
mesh with ``--speculative off``; drafts must have been accepted and rejected both."""

from __future__ import annotations

from pathlib import Path

from tests.support.deepseek import add_mtp_layer, build_deepseek, silence_outputs
from tests.support.mesh import speculation_answers
from tests.support.v4_folder import CONTEXT, build_v4_folder
from tests.support.v4_reference import with_tokenizer


def _answers(
    root: Path, *serve_args: str, stages: int = 2, model: Path | None = None
) -> tuple[list[str], dict[str, float]]:
    return speculation_answers(root, *serve_args, stages=stages, model=model, context=CONTEXT)


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


def _v3_with_echo_mtp(folder: Path) -> Path:
    """A random DeepSeek-V3 (the embedded tokenizer's vocabulary) whose layers add nothing, with
    a multi-token-prediction layer that computes what the model computes for the token after:
    its greedy drafts are right."""
    from seamline.app import default_model_path
    from seamline.weights.gguf import tokenizer_from_gguf

    vocab = tokenizer_from_gguf(default_model_path()).get_vocab_size()
    model, folder = build_deepseek(folder, "v3", vocab_size=vocab, max_position_embeddings=CONTEXT)
    silence_outputs(model)
    model.save_pretrained(folder)
    add_mtp_layer(model, folder, echo=True)
    return with_tokenizer(folder)


def test_the_last_stages_mtp_layer_drafts_for_a_mesh(tmp_path: Path) -> None:
    """DeepSeek-V3 with its MTP layer over two stages: the last stage loads the layer (and its
    own copy of the embedding) from the fragments of layer N, drafts after each draw and sends
    the drafts back with the token; stage 0's windows take them. The answers are those of the
    same mesh with ``--speculative off``; greedy, every draft is right."""
    _assert_mtp_drafts_change_nothing(_v3_with_echo_mtp(tmp_path / "v3"), tmp_path)


def test_the_last_stages_deepseek_v4_mtp_layer_drafts_for_a_mesh(tmp_path: Path) -> None:
    """DeepSeek-V4's MTP layer (``mtp.0.*``) over two stages: packaged as layer N, loaded by the
    last stage with the model's embedding, its cache fed every position; answers as without."""
    _assert_mtp_drafts_change_nothing(build_v4_folder(tmp_path / "v4", echo_mtp=True), tmp_path)


def _assert_mtp_drafts_change_nothing(folder: Path, tmp_path: Path) -> None:
    """The mesh's answers with the default (the last stage's MTP drafts) equal those with
    ``--speculative off``; the drafts, an echo of the model, fill windows of more than 2."""
    plain, _ = _answers(tmp_path / "off", "--speculative", "off", model=folder)
    drafted, counts = _answers(tmp_path / "auto", model=folder)
    assert drafted == plain
    assert counts["method"] == "mtp", counts
    assert counts["windows"] > 0 and 0 < counts["accepted"] < counts["drafted"], counts
    assert counts["tokens_per_window"] > 2, counts
