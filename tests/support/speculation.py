"""Speculative decoding in tests: the scheduler's loop for one sequence, and drafts to give it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from seamline.model.stage import Stage
from seamline.params import SamplingParams
from seamline.runtime.core import EngineCore
from seamline.runtime.group_stage import LockstepStage
from seamline.runtime.speculation import DraftSource, Speculation, SpeculationStats

TOKENS = 64
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0)
SEEDED = SamplingParams(max_tokens=TOKENS, temperature=0.8, top_p=0.9, seed=11)
COOL = SamplingParams(
    max_tokens=TOKENS, temperature=0.1, top_p=0.9, seed=11
)  # draws that are often, not always, the argmax
LIST = (
    "Repeat this list exactly, twice: apples, pears, plums, cherries, figs, dates, limes, lemons."
)


def repetitive_prompt(vocab: int, seed: int = 3) -> list[int]:
    """A random phrase said four times, then its start: n-grams to draft from."""
    phrase = torch.randint(3, vocab, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    return phrase * 4 + phrase[:5]


def generate(
    stage: Stage | LockstepStage,
    prompt: list[int],
    params: SamplingParams,
    speculation: Speculation,
) -> tuple[list[int], int, SpeculationStats]:
    """The tokens, the steps taken and what was speculated, on the scheduler's loop."""
    core = EngineCore.local(stage, 4096, speculation=speculation)
    sequence = core.scheduler.add(prompt, params)
    steps = 0
    while not sequence.finished:
        core.step()
        steps += 1
    return sequence.tokens, steps, core.scheduler.speculated


def partly_right(prompt_len: int) -> Callable[[list[int]], DraftSource]:
    """Drafts of the tokens to come with one in three wrong (where it falls moves along), so
    windows end after 0, 1 or 2 accepted drafts: random weights' answers hold no n-grams."""

    def make(expected: list[int]) -> DraftSource:
        def source(history: list[int], limit: int) -> list[int]:
            done = len(history) - prompt_len
            upcoming = expected[done:][:limit]
            wrong = done % 3
            return [(t + 1) % 96 if i == wrong else t for i, t in enumerate(upcoming)]

        return source

    return make


def mtp_draft_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the checkpoint's multi-token-prediction layer over ``ids``: at each
    position t but the last, from the model's state at t and the token at t+1."""
    from seamline.model.cache import Span
    from seamline.weights.loader import load_stage, open_source

    stage = load_stage(open_source(folder), mtp=True)
    cache = stage.new_cache()
    stage.forward(ids, 0, cache)
    assert stage.hidden is not None
    outputs = stage.draft_states(stage.hidden[:-1], ids[1:], [Span(0, len(ids) - 1, 0, cache)])
    return stage.draft_logits(outputs)


def assert_mtp_changes_no_token(folder: Path, prompt: list[int], params: SamplingParams) -> None:
    """The checkpoint's tokens with its multi-token-prediction drafts are those without, and
    drafts were made."""
    from seamline.runtime.speculation import OFF
    from seamline.weights.loader import load_stage, open_source

    plain, _, _ = generate(load_stage(open_source(folder)), prompt, params, OFF)
    drafted, _, stats = generate(
        load_stage(open_source(folder), mtp=True),
        prompt,
        params,
        Speculation("mtp").for_model(True),
    )
    assert len(plain) == TOKENS
    assert drafted == plain
    assert stats.windows > 0 and stats.drafted > 0


def assert_right_drafts_save_steps(
    stage: Stage | LockstepStage,
    prompt: list[int],
    speculation: Speculation,
    greedy: SamplingParams,
    sampled: SamplingParams,
    steps_share: float,
    sampled_accepts: bool = True,
) -> None:
    """Drafts that are the model's own greedy tokens: greedy, at least 90% are accepted, in under
    ``steps_share`` of the steps; ``sampled``, the draws agree with them only part of the time
    (some accepted, where ``sampled_accepts``). Either way the tokens are those without drafts."""
    from seamline.runtime.speculation import OFF

    for params in (greedy, sampled):
        plain, plain_steps, _ = generate(stage, prompt, params, OFF)
        drafted, steps, stats = generate(stage, prompt, params, speculation)
        assert drafted == plain
        assert stats.drafted > 0
        if params is greedy:
            assert stats.accepted >= 0.9 * stats.drafted and steps < plain_steps * steps_share
        else:
            assert stats.accepted < stats.drafted
            assert stats.accepted > 0 or not sampled_accepts
