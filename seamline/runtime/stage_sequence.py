"""A later stage's record of one sequence (``StageSequence``: its cache, how far it has run, its
prefix hash and its speculative windows), and the last stage's draws for one row of it
(``draw_row``): a token after the row, or after each row of a window while its drafts are
accepted, each with the prefix hash stage 0 checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from seamline.errors import RequestError
from seamline.net.frames import EMPTY_HASH, Row, RowFlag, TokenRow, prefix_hash
from seamline.runtime.grammar import TokenMasks, grammar_mask
from seamline.runtime.sampling import TokenEvent, draw_next
from seamline.runtime.speculation import draws_while_accepted
from seamline.runtime.stage_rows import Drawing, Work, token_flags

WINDOWS_KEPT = 8  # windows a later stage remembers per sequence: a pipeline keeps up to one per stage in flight


@dataclass
class StageSequence:
    """A later stage's record of a sequence: its cache and how far it has run."""

    cache: Any
    drawing: (
        Drawing | None
    )  # None: a private mesh's last stage learns it from stage 0 with the first frame
    next_position: int = 0
    hash: int = EMPTY_HASH
    done: bool = False
    closed: bool = False  # the request is over; its cache stays until stage 0 forgets it
    output: list[int] = field(
        default_factory=list
    )  # tokens generated so far, read from the frames' ids
    # the windows since its last plain row, newest last: (position, prefix hash before, ids)
    windows: list[tuple[int, int, list[int]]] = field(default_factory=list)
    drew: tuple[int, int] | None = None  # (position, token) of the last stage's latest draw for it

    def saw(self, position: int, ids: torch.Tensor | None) -> None:
        """A row's ids at ``position``: those past the output's start are generated tokens."""
        skip = self.drawing.prompt_len - position if self.drawing is not None else 0
        if ids is not None and skip < len(ids):
            self.output.extend(ids[max(skip, 0) :].tolist())

    def ran(self, row: Row, ids: torch.Tensor | None) -> None:
        """``row`` ran here (its ``ids`` beside it): the record moves past it, and remembers it
        if it is a window (a later row may go back into it)."""
        self.saw(row.position, ids)
        self.next_position += row.count
        self.hash = row.hash_after
        if row.flags & RowFlag.WINDOW and ids is not None:
            self.windows = [
                *self.windows[-WINDOWS_KEPT + 1 :],
                (row.position, row.hash_before, ids.tolist()),
            ]
        else:
            self.windows = []

    def rewind(self, position: int, hash_before: int) -> None:
        """Go back to ``position`` inside one of its windows (the drafts from there on were
        rejected: the windows that went on after it are dropped)."""
        self.next_position, self.hash = position, hash_before
        self.windows = [w for w in self.windows if w[0] <= position]
        if self.drawing is not None:
            del self.output[max(0, position - self.drawing.prompt_len) :]

    def resumes_window(self, row: Row, hash_key: bytes | None) -> bool:
        """Whether ``row`` goes on inside one of the windows since the last plain row: after the
        tokens accepted there, with the prefix hash of those positions."""
        return any(
            start <= row.position < start + len(ids)
            and row.hash_before == prefix_hash(hash_before, ids[: row.position - start], hash_key)
            for start, hash_before, ids in self.windows
        )


def draw_row(
    w: Work,
    logits: torch.Tensor,
    seq: StageSequence | None,
    output: list[int],
    masks: TokenMasks | None,
    hash_key: bytes | None,
    failed: Callable[[RequestError], None],
) -> list[TokenRow]:
    """The row's draw (logits [vocab]), or a window's (logits [rows, vocab]: a draw after each
    row while accepted, ``draws_while_accepted``), given what the request generated before the
    row (``output``). [] when a grammar failed (``failed``: the request alone ends, reported)."""
    row, drawing = w.row, w.drawing
    windowed = bool(row.flags & RowFlag.WINDOW)
    drafts = w.token_ids()[1:] if windowed else []
    first = row.position + (1 if windowed else row.count)  # the first draw's position
    hashes = [
        prefix_hash(row.hash_before, w.token_ids()[:1], hash_key) if windowed else row.hash_after
    ]
    rows: list[TokenRow] = []

    def draw(these: torch.Tensor, generated: list[int]) -> TokenEvent | None:
        position = first + len(rows)
        try:
            allowed = grammar_mask(masks, row.request, drawing.params, generated, these.shape[-1])
        except RequestError as exc:
            failed(exc)
            rows.clear()
            return None
        event = draw_next(
            these,
            drawing.params,
            drawing.seed,
            position,
            generated,
            allowed,
            drawing.prompt_len,
            drawing.context_length,
        )
        hashes.append(prefix_hash(hashes[-1], [event.token], hash_key))
        rows.append(
            TokenRow(
                row.request,
                position,
                event.token,
                hashes[-2],
                hashes[-1],
                int(token_flags(event)),
                event.logprob,
                event.top,
            )
        )
        if seq is not None:
            seq.drew = (position, event.token)
            seq.done = seq.done or event.finish_reason is not None
        return event

    draws_while_accepted(logits, drafts, output, draw)
    return rows
