"""Drafts from a model's multi-token-prediction layer (``model/mtp.py``), made after each step
of a process that owns the whole model, for the windows of the next.

After a step's draws are recorded, the layer runs over every row the step computed whose next
token is now known (a prompt chunk's rows, a window's accepted rows and its last), so its own
cache follows the model's positions; the last of those rows gives the first draft of a sequence
that decodes next, and each further draft chains the layer's output and the draft before it one
position on, as many as the sequence's drafter wants. Drafts are the argmax of the layer's
logits: a draft is only a proposal, which the model's own draw keeps or rejects.
"""

from __future__ import annotations

import torch

from seamline.model.cache import SequenceCache, Span
from seamline.model.stage import Stage
from seamline.runtime.scheduler import Batch, SequenceState


def offer_drafts(stage: Stage, batch: Batch) -> None:
    """Run the drafting layer after ``batch`` and offer each decoding sequence its drafts."""
    assert stage.hidden is not None
    rows: list[int] = []
    ids: list[int] = []
    spans: list[Span] = []
    owners: list[SequenceState] = []
    for sequence, span in zip(batch.owners, batch.spans):
        if sequence.drafter is None or sequence.finished or sequence.cache is None:
            continue
        known = len(sequence.prompt) + len(sequence.tokens)
        valid = min(sequence.cached, known - 1) - span.start  # rows whose next token is known
        if valid <= 0:
            continue
        spans.append(Span(len(ids), valid, span.start, sequence.cache))  # type: ignore[arg-type]
        rows += range(span.offset, span.offset + valid)
        ids += sequence.known(span.start + 1, span.start + valid + 1)
        owners.append(sequence)
    if not spans:
        return
    outputs = stage.draft_states(stage.hidden[rows], torch.tensor(ids, dtype=torch.long), spans)
    wants = [_wanted(s) if not s.prefilling else 0 for s in owners]
    chosen = [i for i, want in enumerate(wants) if want > 0]
    if chosen:
        last = outputs[[spans[i].end - 1 for i in chosen]]
        _chain(stage, last, [owners[i] for i in chosen], [wants[i] for i in chosen])


def _wanted(sequence: SequenceState) -> int:
    """The drafts its next window may use: what its drafter wants, within its cache's buffers."""
    assert sequence.drafter is not None and isinstance(sequence.cache, SequenceCache)
    return max(0, min(sequence.drafter.wanted(), sequence.cache.capacity() - sequence.cached - 1))


def _chain(stage: Stage, states: torch.Tensor, sequences: list[SequenceState], wants: list[int]) -> None:
    """Each sequence's drafts (its row of ``states`` the layer's output at its last known
    position): one position further per round, every sequence that wants more in one pass."""
    drafts: list[list[int]] = [[] for _ in sequences]
    active = list(range(len(sequences)))
    while True:
        tokens = stage.draft_logits(states).argmax(dim=-1).tolist()
        for i, token in zip(active, tokens):
            drafts[i].append(token)
        going = [row for row, i in enumerate(active) if len(drafts[i]) < wants[i]]
        if not going:
            break
        active = [active[row] for row in going]
        spans = [Span(row, 1, sequences[i].cached + len(drafts[i]) - 1, sequences[i].cache)  # type: ignore[arg-type]
                 for row, i in enumerate(active)]  # fmt: skip
        next_ids = torch.tensor([drafts[i][-1] for i in active], dtype=torch.long)
        states = stage.draft_states(states[going], next_ids, spans)
    for sequence, draft in zip(sequences, drafts):
        assert sequence.drafter is not None
        sequence.drafter.offered = draft
