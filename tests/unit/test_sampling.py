"""Sampling: greedy, seeded reproducibility, and each filter's effect on the distribution."""

from __future__ import annotations

import pytest
import torch

from seamline.errors import RequestError
from seamline.params import SamplingParams
from seamline.runtime.sampling import (
    draw,
    draw_seed,
    filtered_probs,
    most_likely,
    request_seed,
    sample,
)

LOGITS = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])


def test_greedy_takes_argmax() -> None:
    assert sample(LOGITS, SamplingParams(), 0, 5) == 0


def test_a_draw_depends_only_on_seed_and_position() -> None:
    """Same (seed, position): same token, in any order and after any other draws; other seeds
    and positions give other streams."""
    params = SamplingParams(temperature=1.5)
    forward = [sample(LOGITS, params, 7, p) for p in range(60)]
    backward = [sample(LOGITS, params, 7, p) for p in reversed(range(60))][::-1]
    assert forward == backward
    assert len(set(forward)) > 1  # a temperature of 1.5 really samples
    assert forward != [sample(LOGITS, params, 8, p) for p in range(60)]
    seeds = {draw_seed(s, p) for s in range(-3, 30) for p in range(30)}
    assert len(seeds) == 33 * 30 and all(0 <= x < 2**63 for x in seeds)


def test_a_request_without_a_seed_gets_one() -> None:
    assert request_seed(11) == 11
    assert request_seed(None) != request_seed(None)


def test_top_k_keeps_k_tokens() -> None:
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, False, False, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_smallest_nucleus() -> None:
    full = torch.softmax(LOGITS, -1)
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=float(full[0] + 0.01)))
    assert (probs > 0).tolist() == [True, True, False, False, False]


def test_top_p_keeps_tied_tokens_together_over_a_large_vocabulary() -> None:
    """49,152 tokens (the embedded model's vocabulary): the nucleus is the likeliest tokens
    while the mass before them is under top_p, and every token tied with the last of them."""
    logits = torch.full((49152,), -20.0)
    logits[[5, 900, 40000]] = 3.0  # three tied, 1/3 of the mass each (nearly)
    logits[7] = 2.0
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.nonzero(probs).flatten().tolist() == [5, 900, 40000]
    assert probs.sum().item() == pytest.approx(1.0)


def test_seeded_draws_follow_the_filtered_distribution_and_never_take_a_dropped_token() -> None:
    """Over 4,000 positions the draws' frequencies match the probabilities (within 0.03), and
    a token that top-k dropped is never drawn."""
    params = SamplingParams(temperature=1.0, top_k=4)
    draws = torch.tensor([sample(LOGITS, params, 3, p) for p in range(4000)])
    frequencies = torch.bincount(draws, minlength=5).float() / len(draws)
    assert frequencies[4] == 0
    torch.testing.assert_close(frequencies, filtered_probs(LOGITS, params), atol=0.03, rtol=0)


def test_min_p_drops_unlikely_tokens() -> None:
    full = torch.softmax(LOGITS, -1)
    threshold = float(full[2] / full[0]) + 1e-3  # drops index 2 and below
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, min_p=threshold))
    assert (probs > 0).tolist() == [True, True, False, False, False]


def test_temperature_sharpens() -> None:
    cold = filtered_probs(LOGITS, SamplingParams(temperature=0.5))
    hot = filtered_probs(LOGITS, SamplingParams(temperature=2.0))
    assert cold[0] > torch.softmax(LOGITS, -1)[0] > hot[0]


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(min_p=1.5), dict(max_tokens=0)],
)
def test_invalid_params_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(RequestError):
        SamplingParams(**bad).validate()  # type: ignore[arg-type]


def test_the_drawn_token_comes_first_in_top_logprobs_at_an_exact_tie() -> None:
    logits = torch.zeros(50)
    logits[[7, 2]] = 3.0  # tied: a greedy draw takes the first
    logits[5] = 2.0
    event = draw(logits, SamplingParams(temperature=0.0, logprobs=3), seed=1, position=0)
    assert event.token == 2
    assert [token for token, _ in event.top] == [2, 7, 5]
    # ties past the k-th: the first tokens of them, in order
    flat = draw(torch.zeros(50), SamplingParams(temperature=0.0, logprobs=4), seed=1, position=0)
    assert flat.token == 0 and [t for t, _ in flat.top] == [0, 1, 2, 3]


def test_top_logprobs_are_the_most_likely_tokens_in_order() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    logprobs = torch.log_softmax(logits, dim=-1)
    values, ids = torch.topk(logprobs, 20)
    assert most_likely(logprobs, 20) == tuple(zip(ids.tolist(), values.tolist()))
    assert len(most_likely(logprobs[:5], 20)) == 5  # no more than the vocabulary
