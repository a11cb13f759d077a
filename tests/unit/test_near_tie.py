"""`bench chaos`'s near-tie check: the reference model's logits where two answers first differ."""

from __future__ import annotations

import pytest
import torch

from seamline.params import SamplingParams
from seamline_bench.near_tie import NEAR_TIE, TieJudge, first_difference

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one ended where the other went on
    assert first_difference([], [4]) == 0


@pytest.fixture(scope="module")
def judge() -> TieJudge:
    return TieJudge(context=512)


def test_the_gap_is_that_of_the_two_tokens_chosen_where_the_answers_first_differ(
    judge: TieJudge,
) -> None:
    """The greedy answer against the same answer with its 4th token swapped for the runner-up:
    the gap is the top two logits' difference at that position, computed here on its own."""
    codec, engine = judge.model.codec, judge.model.engine
    prompt = codec.encode_chat(MESSAGES)
    ids = [
        i
        for i in engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0))
        if i != judge.eos
    ]
    cache = engine.stage.new_cache()
    with torch.inference_mode():
        top = engine.prefill(prompt + ids[:3], cache).topk(2)
    engine.stage.release_cache(cache)
    assert int(top.indices[0]) == ids[3]
    calm, swapped = codec.decode(ids), codec.decode(ids[:3] + [int(top.indices[1])])
    assert codec.encode(calm) == ids and codec.encode(swapped) == ids[:3] + [
        int(top.indices[1])
    ]  # text round-trips
    gap = judge.gap(MESSAGES, calm, swapped)
    assert gap == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-5)
    assert judge.near_tie(MESSAGES, calm, swapped) == (gap <= NEAR_TIE)
    assert judge.gap(MESSAGES, calm, calm) is None and not judge.near_tie(MESSAGES, calm, calm)
