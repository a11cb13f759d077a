"""How two engines' greedy answers to one prompt are compared: pure, so it is tested alone.

Each side gives, per generated position, the token it chose and its top log-probabilities
(id -> log-probability, the chosen token among them). Log-probabilities of one position differ
from logits by one shift (the log of the softmax's sum), so the difference of two tokens'
log-probabilities is the difference of their logits: a top-2 gap. ``max_logit_diff`` is the
largest difference of the two sides' log-probabilities of a token both list, over the
positions before any parting (both computed from the same tokens and chose alike).

"Equal" may part only where the reference's own top-2 gap is under twice the largest
difference measured over the whole file (a near tie): each such parting is listed. The
parting position's own difference is left out of that measure: two sides that chose apart
always differ there by at least half the gap, so counting it would excuse every parting.

llama-server gives no log-probabilities for a token that ends inside a UTF-8 character. A
parting there is judged by seamline's gap between the two chosen tokens instead (``gap_from``):
the two sides' gaps, each counted towards its own choice, sum to at most twice the largest
difference, so a near tie on one side is one on both within that bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Top = dict[int, float]  # token id -> log-probability


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    tops: list[Top] = field(default_factory=list)  # per position; may be shorter than tokens


@dataclass(frozen=True)
class Comparison:
    equal: bool  # the same tokens, to the shorter's end where one stopped at an end token
    parted_at: int | None  # the first position whose tokens differ
    near_tie: bool  # parted where the reference's top-2 gap is under twice max_logit_diff
    reference_gap: float | None  # the reference's top-2 gap where they parted (see gap_from)
    max_logit_diff: float
    top5_equal: bool  # the same five likeliest tokens at every shared position
    gap_from: str | None = None  # "llama.cpp", or "seamline" where the reference gave none

    def as_dict(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "parted_at": self.parted_at,
            "near_tie": self.near_tie,
            "reference_gap": self.reference_gap,
            "max_logit_diff": round(self.max_logit_diff, 6),
            "top5_equal": self.top5_equal,
            "gap_from": self.gap_from,
        }


def compare(ours: Answer, reference: Answer) -> Comparison:
    """One prompt's comparison; ``near_tie`` against this prompt's own differences (``summarise``
    judges again against the whole file's)."""
    parted = _first_difference(ours.tokens, reference.tokens)
    shared = len(ours.tokens) if parted is None else parted
    shared = min(shared, len(ours.tops), len(reference.tops))
    diff = max((_top_diff(ours.tops[i], reference.tops[i]) for i in range(shared)), default=0.0)
    top5 = all(  # positions where either side gives no log-probabilities are not judged
        _top_ids(ours.tops[i]) == _top_ids(reference.tops[i])
        for i in range(shared)
        if ours.tops[i] and reference.tops[i]
    )
    gap, gap_from = _parting_gap(ours, reference, parted)
    return Comparison(parted is None, parted, _near(gap, diff), gap, diff, top5, gap_from)


def _parting_gap(
    ours: Answer, reference: Answer, parted: int | None
) -> tuple[float | None, str | None]:
    """The reference's top-2 gap where the answers parted, or where it gave no log-probabilities
    there, ours between our token and the reference's (None where neither side measured it)."""
    if parted is None:
        return None, None
    if parted < len(reference.tops) and reference.tops[parted]:
        return _gap(reference.tops[parted]), "llama.cpp"
    top = ours.tops[parted] if parted < len(ours.tops) else {}
    mine, theirs = ours.tokens[parted], reference.tokens[parted]
    if mine in top and theirs in top and top[theirs] > ZERO:
        return top[mine] - top[theirs], "seamline"
    return None, None


def _near(gap: float | None, noise: float) -> bool:
    return gap is not None and gap < 2 * noise


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Where ``a`` and ``b`` first differ; None where one is a prefix of the other (an answer
    that stopped at an end token while the other was cut at its length, or both alike)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


ZERO = -1e30  # a log-probability below this is a probability of zero (llama-server writes the
# lowest float): no measurement of a logit


def _top_diff(a: Top, b: Top) -> float:
    shared = (t for t in a.keys() & b.keys() if a[t] > ZERO and b[t] > ZERO)
    return max((abs(a[t] - b[t]) for t in shared), default=0.0)


def _top_ids(top: Top, k: int = 5) -> set[int]:
    return set(sorted(top, key=lambda t: -top[t])[:k])


def _gap(top: Top) -> float | None:
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def summarise(rows: list[Comparison]) -> dict[str, Any]:
    """One file's figures over its prompts."""
    noise = max((r.max_logit_diff for r in rows), default=0.0)
    partings = [r for r in rows if not r.equal]
    near = sum(_near(r.reference_gap, noise) for r in partings)
    return {
        "prompts": len(rows),
        "greedy_equal": sum(r.equal for r in rows),
        "near_ties": near,
        "unexplained_partings": len(partings) - near,
        "top5_equal": sum(r.top5_equal for r in rows),
        "max_logit_diff": round(noise, 6),
    }
