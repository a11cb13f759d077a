"""Drafts from a model's multi-token-prediction layer (``model/mtp.py``), made after each step
of a process that owns the whole model, for the windows of the next.

After a step's draws are recorded, the layer runs over every row the step computed whose next
token is now known (a prompt chunk's rows, a window's accepted rows and its last), so its own
cache follows the model's positions; the last of those rows gives the first draft of a sequence
that decodes next, and each further draft chains the layer's output and the draft before it one
position on, as many as the sequence's drafter wants. Drafts are the argmax of the layer's
logits: a draft is only a proposal, which the model's own draw keeps or rejects.

In a pipeline the layer runs on the last stage (``pipeline_drafts``), where the head and the
final states are: after the step's draws, over the rows whose next token is now known (a prompt
chunk's last row waits, kept on its cache, for the next chunk's first token), and a sequence
whose row asked for drafts (``drafts_wanted``) gets them on its last token row, back to stage 0
with it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from seamline.model.cache import SequenceCache, Span
from seamline.model.stage import Stage
from seamline.model.v4_stage import V4Cache
from seamline.net.frames import RowFlag, TokenRow, drafts_wanted
from seamline.runtime.scheduler import Batch, SequenceState
from seamline.runtime.speculation import DRAFT_LIMIT
from seamline.runtime.stage_rows import Work


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
        drafts = _chain(stage, last, [spans[i] for i in chosen], [wants[i] for i in chosen])
        for i, draft in zip(chosen, drafts):
            assert owners[i].drafter is not None
            owners[i].drafter.offered = draft


def pipeline_drafts(
    stage: Stage, work: list[Work], draws: list[list[TokenRow]]
) -> list[list[TokenRow]]:
    """The last stage of a pipeline, after a step of ``work`` and its ``draws`` (each row's
    token rows): the drafting layer over the rows whose next token is known; each row that asked
    for drafts, and drew a token that does not end its request, carries them on its last."""
    assert stage.hidden is not None
    states: list[torch.Tensor] = []
    ids: list[int] = []
    spans: list[Span] = []
    asking: list[tuple[int, int, int]] = []  # (work index, span index, drafts wanted)
    offset = 0
    for index, (w, drawn) in enumerate(zip(work, draws)):
        rows, nexts, first = _known_rows(stage.hidden, w, drawn, offset)
        offset += w.row.count
        if not nexts:
            continue
        goes_on = bool(drawn) and not drawn[-1].flags & RowFlag.DONE
        want = min(drafts_wanted(w.row.flags), _room(w, first + len(nexts))) if goes_on else 0
        if want > 0:
            asking.append((index, len(spans), want))
        spans.append(Span(len(ids), len(nexts), first, w.cache))  # type: ignore[arg-type]
        states.append(rows)
        ids += nexts
    if not spans:
        return draws
    outputs = stage.draft_states(torch.cat(states), torch.tensor(ids, dtype=torch.long), spans)
    if not asking:
        return draws
    chosen = [spans[j] for _, j, _ in asking]
    drafts = _chain(stage, outputs[[s.end - 1 for s in chosen]], chosen, [n for _, _, n in asking])
    draws = list(draws)
    for (index, _, _), draft in zip(asking, drafts):
        last = draws[index][-1]
        draws[index] = [
            *draws[index][:-1],
            replace(last, flags=last.flags | RowFlag.DRAFTS, drafts=tuple(draft)),
        ]
    return draws


def _known_rows(
    hidden: torch.Tensor, w: Work, drawn: list[TokenRow], offset: int
) -> tuple[torch.Tensor, list[int], int]:
    """The final states of ``w``'s rows whose next token is now known, those tokens, and the
    first one's position. A prompt chunk's last row waits in its cache (``draft_pending``) for
    the next chunk's first token, so that the layer's cache has every position."""
    known = [t.token for t in drawn]
    ids = w.token_ids()
    window = bool(w.row.flags & RowFlag.WINDOW)
    nexts = known[: w.row.count] if window else ids[1:] + known[:1]
    rows, first = hidden[offset : offset + len(nexts)], w.row.position
    cache = w.cache
    pending = cache.draft_pending if isinstance(cache, (SequenceCache, V4Cache)) else None
    if pending is not None and pending[0] == first - 1 and ids:
        rows, nexts, first = torch.cat([pending[1], rows]), [ids[0], *nexts], first - 1
    if isinstance(cache, (SequenceCache, V4Cache)):
        last = offset + w.row.count - 1
        waits = not window and not known
        cache.draft_pending = (
            (w.row.position + w.row.count - 1, hidden[last : last + 1].clone()) if waits else None
        )
    return rows, nexts, first


def _room(w: Work, end: int) -> int:
    """The drafts the layer's cache can take after position ``end``: a cache of buffers stops
    at their end; a DeepSeek-V4 cache grows, and takes its drafts' positions back."""
    return w.cache.capacity() - end - 1 if isinstance(w.cache, SequenceCache) else DRAFT_LIMIT


def _wanted(sequence: SequenceState) -> int:
    """The drafts its next window may use: what its drafter wants, within its cache's buffers
    (a DeepSeek-V4 cache has none: it grows and takes back by position)."""
    assert sequence.drafter is not None
    if not isinstance(sequence.cache, SequenceCache):
        return sequence.drafter.wanted()
    return max(0, min(sequence.drafter.wanted(), sequence.cache.capacity() - sequence.cached - 1))


def _chain(
    stage: Stage, states: torch.Tensor, spans: list[Span], wants: list[int]
) -> list[list[int]]:
    """Each span's drafts (its row of ``states`` the layer's output at the span's last
    position): one position further per round, every span that wants more in one pass."""
    drafts: list[list[int]] = [[] for _ in spans]
    active = list(range(len(spans)))
    while True:
        tokens = stage.draft_logits(states).argmax(dim=-1).tolist()
        for i, token in zip(active, tokens):
            drafts[i].append(token)
        going = [row for row, i in enumerate(active) if len(drafts[i]) < wants[i]]
        if not going:
            return drafts
        active = [active[row] for row in going]
        chained = [
            Span(row, 1, spans[i].start + spans[i].count + len(drafts[i]) - 1, spans[i].cache)
            for row, i in enumerate(active)
        ]
        next_ids = torch.tensor([drafts[i][-1] for i in active], dtype=torch.long)
        states = stage.draft_states(states[going], next_ids, chained)
