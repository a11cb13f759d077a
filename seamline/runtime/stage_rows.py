"""What a pipeline stage's batch is made of: rows with their cache and how to draw after them;
and a drawn token as the last stage's token row carries it (flags for its finish reason)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from seamline.net.frames import Row, RowFlag, TokenRow
from seamline.params import SamplingParams
from seamline.runtime.sampling import TokenEvent


class OutOfStep(Exception):
    """A row whose request, position or prefix hash does not match this stage's record."""


@dataclass(frozen=True)
class Drawing:
    """What the last stage needs to draw a sequence's tokens and to say when it ends."""

    params: SamplingParams
    seed: int
    prompt_len: int  # the tokens after it are the output: penalties count them, max_tokens too
    context_length: int


@dataclass(frozen=True)
class Work:
    """One row of a batch: its header, the cache it runs on, its inputs (ids or hidden), and
    the tokens' ids beside the hidden state where the stage's layers need them (DeepSeek-V4)."""

    row: Row
    cache: Any  # SequenceCache, or a lockstep group's GroupCache
    inputs: torch.Tensor
    drawing: Drawing
    ids: torch.Tensor | None = None

    def token_ids(self) -> list[int]:
        """The row's token ids: stage 0's inputs are the ids; a later stage's came beside the hidden state."""
        return [int(t) for t in (self.ids if self.ids is not None else self.inputs).tolist()]


def token_flags(event: TokenEvent) -> RowFlag:
    """A token row's flags for a drawn token: DONE on a request's last, STOPPED too when a stop
    token ended it, LOGPROBS when its log-probabilities travel."""
    flags = RowFlag.NONE if event.finish_reason is None else RowFlag.DONE
    if event.finish_reason == "stop":
        flags |= RowFlag.STOPPED
    if event.logprob is not None:
        flags |= RowFlag.LOGPROBS
    return flags


def token_event(row: TokenRow) -> TokenEvent:
    """The drawn token a token row carries, with the finish reason the last stage's draw gave."""
    reason = (
        "stop" if row.flags & RowFlag.STOPPED else "length" if row.flags & RowFlag.DONE else None
    )
    return TokenEvent(row.token, row.logprob, tuple(row.top), reason)
