"""What a pipeline stage's batch is made of: rows with their cache and how to draw after them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from seamline.net.frames import Row
from seamline.params import SamplingParams


class OutOfStep(Exception):
    """A row whose request, position or prefix hash does not match this stage's record."""


@dataclass(frozen=True)
class Drawing:
    """What the last stage needs to draw a sequence's tokens and to say when it ends."""

    params: SamplingParams
    seed: int
    prompt_len: int
    context_length: int
    output_start: int  # tokens from here on count for presence and frequency penalties


@dataclass(frozen=True)
class Work:
    """One row of a batch: its header, the cache it runs on, its inputs (ids or hidden), and
    the tokens' ids beside the hidden state where the stage's layers need them (DeepSeek-V4)."""

    row: Row
    cache: Any  # SequenceCache, or a lockstep group's GroupCache
    inputs: torch.Tensor
    drawing: Drawing
    ids: torch.Tensor | None = None
