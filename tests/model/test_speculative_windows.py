"""Speculative windows on one process: the output with speculation is the output without it.

Each family (a dense Llama, Mixtral, DeepSeek-V3 from random checkpoints) generates 64 tokens
greedy and seeded (temperature 0.8, top-p 0.9) in float32, with and without drafts that are
partly right (random weights' answers repeat no n-grams), so windows end after 0, 1 or 2
accepted drafts; the embedded model does the same with its n-gram drafts, in float32 and at
the default precision (bfloat16 activations, int8 blocks), where a window's rows must compute
as one-row steps do. The tokens must be equal, and drafts must have been made, accepted and
rejected (else the test would compare two runs without speculation). A source that drafts
only wrong tokens accepts none; one that drafts the right ones accepts all, in fewer steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from seamline.app import LocalModel, default_model_path
from seamline.model.stage import Stage
from seamline.params import SamplingParams
from seamline.quant.matmul import set_int8_activations
from seamline.runtime.speculation import OFF, DraftSource, Speculation, SpeculationStats
from seamline.weights.loader import load_stage
from tests.support.configs import checkpoint_source
from tests.support.speculation import (
    GREEDY,
    LIST,
    SEEDED,
    TOKENS,
    generate,
    partly_right,
    repetitive_prompt,
)


def _same_with_and_without(
    stage: Stage,
    prompt: list[int],
    params: SamplingParams,
    source: Callable[[list[int]], DraftSource] | None = None,
) -> SpeculationStats:
    """``source`` makes the drafts from the output without speculation (None: n-grams)."""
    plain, _, _ = generate(stage, prompt, params, OFF)
    speculation = (
        Speculation("ngram") if source is None else Speculation("ngram", source=source(plain))
    )
    drafted, _, stats = generate(stage, prompt, params, speculation)
    assert len(plain) == TOKENS
    assert drafted == plain
    assert stats.windows > 0 and stats.drafted > 0
    return stats


@pytest.mark.parametrize("kind", ["dense", "mixtral", "deepseek_v3", "deepseek_v4"])
def test_drafts_change_no_token(kind: str, tmp_path: Path) -> None:
    stage = load_stage(checkpoint_source(kind, tmp_path))
    prompt = repetitive_prompt(stage.config.vocab_size)
    for params in (GREEDY, SEEDED):
        stats = _same_with_and_without(stage, prompt, params, partly_right(len(prompt)))
        assert 0 < stats.accepted < stats.drafted


def test_ngram_drafts_change_no_token_of_the_embedded_model(tmp_path: Path) -> None:
    model = LocalModel.load(default_model_path())  # float32: the exact path
    stage = model.engine.stage
    for params in (GREEDY, SEEDED):
        stats = _same_with_and_without(
            stage, model.codec.encode_chat([{"role": "user", "content": LIST}]), params
        )
        assert stats.accepted > 0


@pytest.fixture(scope="module")
def fast_model() -> Iterator[LocalModel]:
    """The embedded model at the default precision, which holds for the process's quantized
    matmuls: the other tests' exact path is put back after."""
    yield LocalModel.load(default_model_path(), precision="fast")
    set_int8_activations(False)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_change_no_token_at_the_default_precision(
    fast_model: LocalModel, params: SamplingParams
) -> None:
    prompt = fast_model.codec.encode_chat([{"role": "user", "content": LIST}])
    stats = _same_with_and_without(fast_model.engine.stage, prompt, params)
    assert stats.accepted > 0


def _scripted(expected: list[int], prompt_len: int, right: bool) -> DraftSource:
    """Drafts the tokens the model will draw next (``right``), or tokens it will not."""

    def source(history: list[int], limit: int) -> list[int]:
        upcoming = expected[len(history) - prompt_len :][:limit]
        return upcoming if right else [(token + 1) % 256 for token in upcoming]

    return source


@pytest.mark.parametrize("right", [False, True], ids=["every-draft-wrong", "every-draft-right"])
def test_scripted_drafts_are_all_rejected_or_all_accepted(right: bool, tmp_path: Path) -> None:
    stage = load_stage(checkpoint_source("dense", tmp_path))
    prompt = repetitive_prompt(stage.config.vocab_size)
    expected, plain_steps, _ = generate(stage, prompt, SEEDED, OFF)
    source: Callable[[list[int], int], list[int]] = _scripted(expected, len(prompt), right)
    drafted, steps, stats = generate(
        stage, prompt, SEEDED, Speculation("ngram", draft_max=4, source=source)
    )
    assert drafted == expected
    assert stats.drafted > 0
    if right:
        assert stats.accepted == stats.drafted
        assert (
            steps <= plain_steps // 4
        )  # a prefill, then windows of 4 drafts and the token after them
    else:
        assert stats.accepted == 0
        assert steps == plain_steps
