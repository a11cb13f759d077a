"""Digests: a stage's commitment to what it received and what it computed, small enough to
report for every row of every frame, and checked against the coordinator's own computation.

A row's digest is the sum over its tokens of a random projection of each token's tensor
(``DIGEST_WIDTH`` numbers), each token weighted by a function of its position, so a change to
any token of the row changes the digest. The projection is drawn from the plan's seed: a stage
cannot make a wrong tensor digest like the right one without computing the right one. Two
digests of the same row agree to within float rounding; ``differs`` compares them relative to
the digest's own scale (the root of the summed squares of its terms), since the terms' signs
may cancel.
"""

from __future__ import annotations

import base64
import math
from functools import lru_cache

import torch

from seamline.model.cache import Span

DIGEST_WIDTH = 16
# How far two digests of the same row may differ, relative to its scale: the coordinator runs a
# sequence alone where a stage ran it batched with others, and a 16-bit residual rounds at ~4e-3.
# At the default precision (int8 blocks) a step past the int8 kernels' rows (bfloat16 tiles) puts
# honest rows of the embedded model up to 5x bfloat16's tolerance away, while a row scaled by
# 1.05 lies 0.85x away: no tolerance tells them apart (tests/model/test_int8_checks.py).
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 6e-2, torch.float16: 2e-2}
# A checked mesh computes every int8 row as it would alone (``Precision.rows_alone``: matmuls and
# attention): measured on the embedded model, stages batching 8-160 decode rows or 320 prompt
# rows a step, or a prompt in other chunks, at one thread against the reference's two, the rows
# were the reference's to the bit and their digests at most 5.4e-8 of their scale apart (float32
# sums); ALONE_TOLERANCE is ~2e4 times that, and a row scaled by 1.05 lies 51x beyond it. A
# last-bit change of half a stage's input moves its output 6e-3 to 1e-1 (int8 rounding amplifies
# it): honest members are those whose kernels compute to the bit as the coordinator's.
ALONE_TOLERANCE = 1e-3


@lru_cache(maxsize=16)
def projection(width: int, seed: int) -> torch.Tensor:
    """[width, DIGEST_WIDTH] float32, N(0, 1/width): the same for every process given the seed."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + width) & 0x7FFFFFFFFFFFFFFF)
    return torch.randn(width, DIGEST_WIDTH, generator=generator) / math.sqrt(width)


def position_weights(start: int, count: int) -> torch.Tensor:
    """A weight in [0.5, 1.5] per position: never zero, different from one position to the next."""
    positions = torch.arange(start, start + count, dtype=torch.float64)
    return (1.0 + 0.5 * torch.sin(positions * 0.6180339887 + 0.5)).float()


def row_terms(x: torch.Tensor, start: int, seed: int) -> torch.Tensor:
    """Each token's weighted projection, [tokens, DIGEST_WIDTH]; ``x`` is [tokens, ...]."""
    flat = x.reshape(x.shape[0], -1).float()
    return (flat @ projection(flat.shape[1], seed)) * position_weights(start, x.shape[0])[:, None]


def digest(x: torch.Tensor, start: int, seed: int) -> torch.Tensor:
    """The row's digest [DIGEST_WIDTH]: tokens of ``x`` at positions ``start``... ."""
    return row_terms(x, start, seed).sum(0)


def scale(x: torch.Tensor, start: int, seed: int) -> float:
    return float(row_terms(x, start, seed).square().sum().sqrt())


def differs(
    got: torch.Tensor,
    expected: torch.Tensor,
    expected_scale: float,
    dtype: torch.dtype,
    rows_alone: bool = False,
) -> float:
    """How far ``got`` is from ``expected`` in units of the tolerance (above 1: a different
    tensor, not rounding): ``dtype``'s, or ``ALONE_TOLERANCE`` where rows are computed alone."""
    distance = float((got.float() - expected.float()).norm())
    if not math.isfinite(
        distance
    ):  # a NaN or infinity where the reference has numbers (or both have)
        return math.inf
    tolerance = ALONE_TOLERANCE if rows_alone else TOLERANCE.get(dtype, 2e-3)
    return distance / (tolerance * max(expected_scale, 1e-12))


def pack(digests: torch.Tensor) -> str:
    """[rows, k, DIGEST_WIDTH] float32 as text for a control message (base64)."""
    return base64.b64encode(digests.contiguous().float().numpy().tobytes()).decode()


def unpack(text: str, rows: int, per_row: int) -> torch.Tensor:
    """The digests ``pack`` made; ValueError when the text does not hold ``rows`` × ``per_row``."""
    raw = base64.b64decode(text.encode(), validate=True)
    if len(raw) != rows * per_row * DIGEST_WIDTH * 4:
        raise ValueError(f"{len(raw)} bytes of digests for {rows} rows of {per_row}")
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(rows, per_row, DIGEST_WIDTH)


def probe_output(
    stage: object, ids: torch.Tensor, hidden: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """A probe's output and the position of its first row: every row of the probe at positions
    0.. on a fresh cache, or where the stage has the head, the last row's logits (all that a
    lockstep group's head gathers)."""
    last_only = getattr(stage, "head", None) is not None
    inputs = ids if hidden is None else hidden
    cache = stage.new_cache()  # type: ignore[attr-defined]
    spans = [Span(0, inputs.shape[0], 0, cache)]
    try:
        if getattr(stage, "passes_ids", False) and hidden is not None:
            out = stage.forward_batch(inputs, spans, last_only=last_only, ids=ids)  # type: ignore[attr-defined]
        else:
            out = stage.forward_batch(inputs, spans, last_only=last_only)  # type: ignore[attr-defined]
    finally:
        stage.release_cache(cache)  # type: ignore[attr-defined]
    return out, (inputs.shape[0] - 1 if last_only else 0)
