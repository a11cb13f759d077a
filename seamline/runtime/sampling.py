"""Token sampling: greedy, or seeded temperature / top-k / top-p / min-p. Pure functions.

A draw's randomness is a pure function of the request's seed and the position the drawn token
takes (``draw_seed``), so a sequence draws the same tokens alone or in a batch, and a sequence
replayed from its history (prompt + tokens so far) goes on exactly as it would have. The draw
is the inverse of the filtered distribution's cumulative mass at one uniform number (about 30x
faster than ``torch.multinomial`` over a 49k vocabulary, which seeded draws used before).

Before the draw, ``logit_bias`` is added and the presence and frequency penalties of the
tokens generated so far are taken off, as OpenAI documents them; a grammar's mask, if any,
leaves only the tokens it allows. Log-probabilities, when asked,
are the model's own: the log-softmax of the raw logits, before bias, penalties and temperature.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from seamline.params import SamplingParams

_U64 = (1 << 64) - 1


def request_seed(seed: int | None) -> int:
    """The seed a request samples with: its own, or a random one chosen once."""
    return seed if seed is not None else secrets.randbits(63)


def draw_seed(seed: int, position: int) -> int:
    """The seed of the draw for ``position``: splitmix64's finaliser over (seed, position), so
    nearby seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return (z ^ (z >> 31)) >> 1  # 63 bits: torch takes a signed 64-bit seed


@dataclass(frozen=True)
class TokenEvent:
    """A token drawn for a request, as it crosses every seam up to the API (the scheduler's
    emission, a pipeline's token row read back, a backend's stream): its id; with ``logprobs``
    asked, its log-probability and the likeliest ids with theirs; and on the request's last
    token, why it ended (``finish_reason``)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = (
        None  # "stop": a stop token; "length": max_tokens, or the context full
    )

    @property
    def shown(self) -> bool:
        """Whether the token is part of the output: a stop token ends it but is not in it."""
        return self.finish_reason != "stop"


def adjusted(
    logits: torch.Tensor, params: SamplingParams, generated: Sequence[int] = ()
) -> torch.Tensor:
    """The logits a draw picks from: ``logit_bias`` added, and for each token generated so far
    ``count * frequency_penalty + presence_penalty`` taken off."""
    if not params.logit_bias and not (params.penalised and generated):
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    for token, bias in params.logit_bias:
        if 0 <= token < vocab:
            out[token] += bias
    if params.penalised and generated:
        counts = Counter(t for t in generated if 0 <= t < vocab)
        ids = torch.tensor(list(counts), dtype=torch.long)
        times = torch.tensor(list(counts.values()), dtype=torch.float32)
        out[ids] -= times * params.frequency_penalty + params.presence_penalty
    return out


def draw(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    position: int,
    generated: Sequence[int] = (),
    allowed: torch.Tensor | None = None,
) -> TokenEvent:
    """``sample`` among the ``allowed`` tokens (a grammar's mask; None: all), and the
    log-probabilities the request asked for."""
    choices = adjusted(logits, params, generated)
    if allowed is not None:
        choices = choices.float().masked_fill(~allowed, float("-inf"))
    token = sample(choices, params, seed, position)
    if params.logprobs is None:
        return TokenEvent(token)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = most_likely(logprobs, params.logprobs) if params.logprobs else ()
    return TokenEvent(token, float(logprobs[token]), top)


def most_likely(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely (token, log-probability) pairs, ties in token order: as a greedy
    draw takes the first of tied tokens, so the drawn one comes first at an exact tie (torch's
    topk orders ties as it likes)."""
    values = logprobs.numpy()
    k = min(k, values.shape[0])
    kth = np.partition(values, values.shape[0] - k)[values.shape[0] - k]
    tied = np.flatnonzero(values >= kth)  # every token as likely as the k-th: ascending ids
    order = tied[np.argsort(-values[tied], kind="stable")][:k]
    return tuple(zip(order.tolist(), values[order].tolist()))


def draw_next(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    position: int,
    generated: Sequence[int],
    allowed: torch.Tensor | None,
    prompt_len: int,
    context_length: int,
) -> TokenEvent:
    """The token for ``position`` and whether the request ends with it: the one sampler and the
    one finish rule, applied where a token is drawn (one process's scheduler, a pipeline's last
    stage); every later seam carries the reason on."""
    drawn = draw(logits, params, seed, position, generated, allowed)
    return replace(
        drawn,
        finish_reason=finish_reason(drawn.token, position, params, prompt_len, context_length),
    )


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [vocab] after temperature, top-k, top-p and min-p (in that order)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` with the tokens outside the top-p nucleus zeroed: in descending order, the
    tokens while the mass strictly before them is under ``top_p`` (the most likely always), and
    every token as likely as the last of them (ties stay together, whatever their order).
    numpy's sort of the values: about 25x faster than torch's sort with indices."""
    values = probs.numpy()
    descending = np.sort(values)[::-1]
    before = np.cumsum(descending, dtype=np.float64) - descending
    threshold = descending[int(np.count_nonzero(before < top_p)) - 1]
    return torch.from_numpy(np.where(values >= threshold, values, 0.0).astype(values.dtype))


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """One token id from logits [vocab], for the token that will take ``position``: the inverse
    of the filtered distribution's cumulative mass at one uniform number from (seed, position)."""
    if params.greedy:  # numpy's argmax is ~20x faster than torch's on one CPU vector
        return int(logits.float().numpy().argmax())
    probs = filtered_probs(logits, params).numpy()
    generator = torch.Generator().manual_seed(draw_seed(seed, position))
    uniform = float(torch.rand(1, generator=generator, dtype=torch.float64))
    cumulative = np.cumsum(probs, dtype=np.float64)
    # the first token whose cumulative mass passes the draw: never one of no mass (it adds none)
    return min(
        int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right")), len(probs) - 1
    )


def finish_reason(
    token: int, position: int, params: SamplingParams, prompt_len: int, context_length: int
) -> str | None:
    """Why a sequence ends with ``token`` drawn for ``position``: "stop" (a stop token, not part
    of the output), "length" (max_tokens drawn, or the context full), or None. A function of
    the position alone, so a stage that only samples and a replayed sequence agree on it."""
    if token in params.stop_token_ids:
        return "stop"
    if position - prompt_len + 1 >= params.max_tokens or position + 1 >= context_length:
        return "length"
    return None
