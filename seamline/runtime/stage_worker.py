"""StageWorker: one pipeline stage's data path, independent of how its links were made.

Stage 0 is the pipeline's runtime (``PipelineHead``: the scheduler, with its sequence
records, admission, chunked prefill and preemption); it embeds prompts and the tokens the last
stage sends back. Every later stage runs its layers on the hidden-state frames it receives and
passes them on; the last stage samples and sends the token id straight back to stage 0 (and a
copy to the coordinator, which streams it to the client). Every row is checked against the
stage's record of its sequence — position and prefix hash — so a frame that is out of step is
refused instead of computing garbage; a row that starts over at position 0 (stage 0 preempted
the sequence and recomputes it) resets that record and its cache.

Rows travel and run together: the rows of one frame are one batched forward
(``Stage.forward_batch``: each weight multiplied once for all of them, attention per
sequence), and the last stage samples every row of it and returns the tokens in one frame.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from seamline.errors import RequestError
from seamline.model.cache import Span, logit_rows, logits_by_span
from seamline.model.devices import to_host
from seamline.model.stage import Stage
from seamline.net.frames import (
    EMPTY_HASH,
    HiddenFrame,
    Row,
    RowFlag,
    TokenFrame,
    TokenRow,
)
from seamline.net.messages import Close, Forget, Fork, Message, Open, Prompt
from seamline.params import SamplingParams
from seamline.runtime import digest
from seamline.runtime.grammar import TokenMasks
from seamline.runtime.idle_clock import IdleClock
from seamline.runtime.kept_inputs import KeptInputs
from seamline.runtime.mtp_drafts import pipeline_drafts
from seamline.runtime.pipeline_head import PipelineHead
from seamline.runtime.sampling import request_seed
from seamline.runtime.stage_rows import Drawing, OutOfStep, Work
from seamline.runtime.stage_sequence import StageSequence, draw_row
from seamline.runtime.step_clock import StepClock

if TYPE_CHECKING:
    from seamline.runtime.group_stage import LockstepStage

log = logging.getLogger("seamline.stage")
SendHidden = Callable[
    [list[Row], torch.Tensor, torch.Tensor | None, tuple[bytes, bytes] | None], None
]  # rows, hidden states, their token ids, the signed statement of their digests
RowKeys = list[tuple[int, int, int]]  # (request, position, count) per row
Receipt = tuple[RowKeys, tuple[bytes, bytes]]  # a frame's rows and its sender's statement
SendTokens = Callable[[list[TokenRow]], None]
SendMessage = Callable[[Message], None]
RECENTLY_CLOSED = 1024  # late frames of these requests are dropped quietly
MAX_SEQUENCES = 4096  # a later stage holds at most this many (open, or kept for prefixes): stage 0 never asks more


@dataclass
class StageLinks:
    """Where this stage's output goes; None where the stage has no such neighbour."""

    downstream: SendHidden | None = None  # next stage (hidden frames)
    downstream_message: SendMessage | None = (
        None  # next stage: Open, Fork, Forget, in order with the frames
    )
    stage0: SendTokens | None = None  # last stage -> stage 0 (tokens)
    results: SendTokens | None = None  # last stage -> coordinator (tokens)
    refused: Callable[[int, str], None] | None = (
        None  # a row refused here: its request and why (the request fails at once, and replays)
    )
    failed: Callable[[list[int], Exception], None] | None = (
        None  # stage 0 could not run these requests
    )
    digests: Callable[[RowKeys, torch.Tensor, Receipt | None], None] | None = (
        None  # rows, their digests, the statement of the frame they came in
    )
    sign: Callable[[RowKeys, torch.Tensor, torch.Tensor], tuple[bytes, bytes]] | None = (
        None  # the statement of what goes downstream: the rows' output digests and bytes
    )


class StageWorker:
    def __init__(
        self,
        stage: Stage | LockstepStage,
        is_first: bool,
        is_last: bool,
        context_length: int = 0,
        kv_budget_bytes: int | None = None,
    ) -> None:
        self.stage = stage
        self.dtype = stage.compute_dtype
        self.is_first = is_first
        self.is_last = is_last
        self.links = StageLinks()
        self.sequences: dict[int, StageSequence] = {}  # stages after the first
        self.closed: dict[int, None] = {}  # insertion-ordered set of recently closed requests
        self.lock = threading.Lock()
        self.refused = 0
        self.stale_windows = (
            0  # the last stage: windows that went on from one not accepted whole, not drawn from
        )
        self.step_probe: dict[
            int, float
        ] = {}  # rows -> seconds of one step, as probed after loading
        self.prompt_probe: dict[int, float] = {}  # prompt rows -> seconds of a step of that many
        self.probe_quiet = False  # the probe was taken again on an idle stage and quiet cores (``mesh.node.reprobe``)
        self.forward_lock = (
            threading.Lock()
        )  # a forward at a time: a probe taken while it serves holds it too
        self.busy_seconds = 0.0  # every forward's seconds, prompt chunks' too
        self.idle = (
            IdleClock()
        )  # waiting with nothing to run (stage 0: its driver; the others: their frames)
        self.decode_steps = 0  # forwards of decode rows only, and the seconds they took
        self.decode_seconds = 0.0
        self.clock = (
            StepClock()
        )  # a decode step's seconds outside its forward, on the stage's thread
        self.stages = 1  # the pipeline's stage count (set by the route)
        self.micro_batches = (
            1  # batches stage 0 keeps in flight: at least the stage count (set by the route)
        )
        self.masks: TokenMasks | None = (
            None  # the last stage's grammars, where it holds the tokenizer
        )
        self.digest_seed = (
            0  # report every row's digests under this seed (0: none): the coordinator checks them
        )
        self.receipt: Receipt | None = None  # the statement of the frame being run (under ``lock``)
        self.kept: KeptInputs | None = None  # a checked mesh's later stage: the rows it took
        # A private mesh (``--private``): stage 0 sends on no token id and no sampling parameter (``private``),
        # and the last stage, in the same process, draws with stage 0's records (``source``); both key the
        # rows' prefix hashes (``hash_key``), so a member between them reads no token from a frame.
        self.private = False
        self.source: PipelineHead | None = None
        self.hash_key: bytes | None = None
        context = context_length or stage.config.max_position_embeddings
        self.head = PipelineHead(self, context, kv_budget_bytes) if is_first else None

    def stop(self) -> None:
        """A new plan replaced this stage (stage 0: its driver thread ends)."""
        if self.head is not None:
            self.head.stop()

    # -- session calls (mirrored to every stage by the coordinator) --------------------
    def open(self, msg: Open) -> None:
        """Create the sequence here, then pass the call on down the pipeline: it travels on the
        same link as the request's frames, so it always reaches the next stage before them."""
        if self.head is not None:
            self.head.open(msg)
        else:
            drawing = self._drawing(msg)
            with self.lock:
                if len(self.sequences) >= MAX_SEQUENCES and msg.request not in self.sequences:
                    self.refused += 1
                    log.warning(
                        "refused to open request %d: %d sequences held here already",
                        msg.request,
                        MAX_SEQUENCES,
                    )
                    return
                self.sequences[msg.request] = StageSequence(
                    self.stage.new_cache(msg.sampling.argmax_only), drawing
                )
        self._pass_on(msg)

    def close(self, msg: Close) -> None:
        """The request is over. Stage 0 decides what becomes of its cache and passes the close
        on; a later stage keeps the cache until stage 0 forgets it."""
        with self.lock:
            self._closed(msg.request)
        if self.head is not None:
            self.head.close(msg.request)
            return
        with self.lock:
            if (seq := self.sequences.get(msg.request)) is not None:
                seq.closed = True
        self._pass_on(msg)

    def lifetime(self, msg: Fork | Forget) -> None:
        """Stages after the first: stage 0 forked or freed a cache; do the same, pass it on."""
        with self.lock:
            seq = self.sequences.get(msg.request)
            if isinstance(msg, Forget):
                self.sequences.pop(msg.request, None)
                self._closed(msg.request)
                if self.kept is not None:
                    self.kept.forget(msg.request)
                if seq is not None:
                    self.stage.release_cache(seq.cache)
            elif seq is None or (donor := self.sequences.get(msg.donor)) is None:
                self.refused += 1
                log.warning(
                    "refused fork of request %d from %d: not both open here", msg.request, msg.donor
                )
            elif msg.positions > donor.next_position:  # a row of it was refused here
                self.refused += 1
                log.warning(
                    "refused fork of request %d from %d: %d positions, this stage holds %d",
                    msg.request,
                    msg.donor,
                    msg.positions,
                    donor.next_position,
                )
            else:
                self.stage.release_cache(seq.cache)
                seq.cache, seq.done, seq.output = donor.cache.fork(msg.positions), False, []
                seq.next_position, seq.hash = msg.positions, msg.hash
                if self.kept is not None:
                    self.kept.fork(msg.request, msg.donor, msg.positions)
        self._pass_on(msg)

    def _pass_on(self, msg: Message) -> None:
        if not self.is_last and self.links.downstream_message is not None:
            self.links.downstream_message(_stripped(msg) if self.private else msg)

    def _drawing(self, msg: Open) -> Drawing | None:
        """How the request draws: as its Open says, or on a private mesh's last stage as stage 0
        in this process has it (the Open that came through the members says nothing). Stage 0
        passes the Open on before the prompt has come whole, so there it may not be known yet:
        None, and the first frame (which leaves stage 0 only after the prompt) resolves it."""
        if self.source is not None:
            return self.source.drawing(msg.request)
        return Drawing(
            msg.sampling, request_seed(msg.sampling.seed), msg.prompt_len, msg.context_length
        )

    def holdings(self) -> dict[str, int]:
        """The sequences open here and the KV cache bytes they hold, and the bytes of finished
        requests' caches kept for prompts that begin alike (a lockstep group: this rank's)."""
        if self.head is not None:
            open_caches, kept = self.head.caches()
        else:
            with self.lock:
                open_caches = [seq.cache for seq in self.sequences.values() if not seq.closed]
                kept = [seq.cache for seq in self.sequences.values() if seq.closed]
        return {
            "sequences": len(open_caches),
            "kv_bytes": _nbytes(open_caches),
            "kept_kv_bytes": _nbytes(kept),
            "micro_batches": self.micro_batches if self.is_first else 0,
        }

    def speculated(self) -> dict[str, int]:
        """Stage 0: its windows, drafts, accepted drafts and windows sent on behind others so far;
        the last stage: the windows it found stale."""
        counts = {"stale_windows": self.stale_windows} if self.stale_windows else {}
        if self.head is None:
            return counts
        stats = self.head.scheduler.speculated
        return {
            **counts,
            "windows": stats.windows,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "follows": stats.follows,
        }

    # -- data path ----------------------------------------------------------------------
    def prompt(self, msg: Prompt) -> None:
        """Stage 0: queue the prompt; the pipeline's scheduler runs it in chunks with other rows."""
        if self.head is None:
            raise OutOfStep(f"request {msg.request}: a prompt reached a stage that does not embed")
        self.head.prompt(msg.request, list(msg.tokens), msg.more)

    def tokens(self, frame: TokenFrame) -> None:
        """Stage 0: tokens sampled by the last stage come back to be embedded."""
        if self.head is None:
            raise OutOfStep("tokens reached a stage that does not embed")
        self.head.returned(list(frame.rows))

    def hidden(self, frame: HiddenFrame) -> None:
        """Stages after the first: run our layers on each row and pass it on."""
        boundary = self.stage.boundary_shape
        if tuple(frame.tensor.shape[1:]) != boundary or frame.tensor.dtype != self.dtype:
            self.refused += 1
            log.warning(
                "refused frame: tensor %s %s, this stage takes [tokens, %s] %s",
                frame.tensor.dtype,
                tuple(frame.tensor.shape),
                ", ".join(map(str, boundary)),
                self.dtype,
            )
            self._tell_refused(frame.rows, "its tensor is not of this stage's shape and dtype")
            return
        if frame.ids is None and (self.stage.passes_ids or (self.is_last and self.source is None)):
            self.refused += 1
            log.warning(
                "refused frame: no token ids beside the hidden state, which this stage needs"
            )
            self._tell_refused(frame.rows, "it carries no token ids, which this stage needs")
            return
        self.clock.begin()
        with self.lock:
            work: list[Work] = []
            offset = 0
            for row in frame.rows:
                x = frame.tensor[offset : offset + row.count]
                ids = frame.ids[offset : offset + row.count] if frame.ids is not None else None
                offset += row.count
                try:
                    if any(w.row.request == row.request for w in work):
                        raise OutOfStep(f"request {row.request} has two rows in one frame")
                    seq = self._check_row(row)
                except OutOfStep as exc:
                    if self._ended_before(row):
                        self.stale_windows += 1
                    else:
                        self.refuse(row.request, "frame", exc)
                    continue
                seq.ran(row, ids)
                if self.kept is not None:
                    self.kept.keep(row.request, row.position, x)
                assert seq.drawing is not None  # _check_row resolved it
                work.append(Work(row, seq.cache, x, seq.drawing, ids))
            keys = [(r.request, r.position, r.count) for r in frame.rows]
            self.receipt = (keys, frame.signed) if frame.signed is not None else None
            try:
                self.run_batch(work)
            finally:
                self.receipt = None
        self.clock.end()

    def refuse(self, request: int, what: str, exc: Exception) -> None:
        if request in self.closed:
            return  # in flight when the request was closed: expected, not an error
        self.refused += 1
        log.warning("refused %s: %s", what, exc)
        self._tell_refused([request], f"refused {what}: {exc}")

    def _tell_refused(self, rows: Sequence[Row | int], why: str) -> None:
        """The coordinator hears of each request whose row was refused here: left waiting, it
        would hang until its client gave up."""
        if self.links.refused is None:
            return
        for request in dict.fromkeys(r if isinstance(r, int) else r.request for r in rows):
            self.links.refused(request, why)

    def run_batch(self, work: list[Work]) -> list[TokenRow]:
        """Run our layers on every row at once; pass the rows on as one frame, or sample them.
        Returns the tokens a first-and-last stage loops back."""
        if self.is_last:
            work = [w for w in work if not self._stale(w)]
        if not work:
            return []
        inputs = work[0].inputs if len(work) == 1 else torch.cat([w.inputs for w in work])
        spans, offset = [], 0
        for w in work:
            spans.append(
                Span(
                    offset,
                    w.row.count,
                    w.row.position,
                    w.cache,
                    rowwise=bool(w.row.flags & RowFlag.WINDOW),
                )
            )
            offset += w.row.count
        started, cpu_started = time.perf_counter(), time.thread_time()
        ids = self._ids(
            work, inputs
        )  # every frame carries them: the sampler counts generated tokens
        windowed = self.is_last and any(s.rowwise for s in spans)
        # a window draws after every row: its every row's logits
        rows: dict[str, Any] = (
            {"logit_rows": logit_rows(spans)} if windowed else {"last_only": self.is_last}
        )
        if self.stage.passes_ids:
            rows["ids"] = ids
        with self.forward_lock:
            out = to_host(
                self.stage.forward_batch(inputs, spans, **rows)
            )  # a GPU stage's one crossing out
        spent = time.perf_counter() - started
        self.busy_seconds += spent
        decode_only = all(w.row.count == 1 for w in work)
        self.clock.forward(time.thread_time() - cpu_started, len(work) if decode_only else None)
        if decode_only:
            self.decode_steps += 1
            self.decode_seconds += spent
        signed = self._report_digests(work, inputs, out) if self.digest_seed else None
        if not self.is_last:
            assert self.links.downstream is not None, "a middle stage needs a downstream link"
            self.links.downstream([w.row for w in work], out, ids, signed)
            return []
        draws = [
            self._sample(w, logits) if w.row.flags & RowFlag.SAMPLE else []
            for w, logits in zip(work, logits_by_span(spans, out) if windowed else out)
        ]
        if (
            getattr(self.stage, "mtp", None) is not None
        ):  # the model's drafts travel back with the tokens
            draws = pipeline_drafts(self.stage, work, draws)  # type: ignore[arg-type]
        sampled = [token for drawn in draws for token in drawn]
        if sampled and not self.is_first and self.links.stage0 is not None:
            self.links.stage0(sampled)  # the critical path first: stage 0 waits for these tokens
        if sampled and self.links.results is not None:
            self.links.results(sampled)
        return sampled if self.is_first else []

    # -- internals ----------------------------------------------------------------------
    def _report_digests(
        self, work: list[Work], inputs: torch.Tensor, out: torch.Tensor
    ) -> tuple[bytes, bytes] | None:
        """A checked mesh's stage: report the rows' digests (with the statement of the frame
        they came in); the signed statement of what goes downstream (None: nothing signs)."""
        keys = [(w.row.request, w.row.position, w.row.count) for w in work]
        digests = self._digests(work, inputs, out)
        if self.links.digests is not None:
            self.links.digests(keys, digests, self.receipt)
        sign = self.links.sign
        return sign(keys, digests[:, 1], out) if sign is not None and not self.is_last else None

    def _digests(self, work: list[Work], inputs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """[rows, 2, DIGEST_WIDTH]: each row's input (none at stage 0: token ids) and output (the
        last stage: its last position's logits) as the coordinator's check computes them."""
        result = torch.zeros(len(work), 2, digest.DIGEST_WIDTH)
        offset = 0
        for i, w in enumerate(work):
            rows = slice(offset, offset + w.row.count)
            if not self.is_first:
                result[i, 0] = digest.digest(inputs[rows], w.row.position, self.digest_seed)
            if self.is_last:
                result[i, 1] = digest.digest(
                    out[i : i + 1], w.row.position + w.row.count - 1, self.digest_seed
                )
            else:
                result[i, 1] = digest.digest(out[rows], w.row.position, self.digest_seed)
            offset += w.row.count
        return result

    def _ids(self, work: list[Work], inputs: torch.Tensor) -> torch.Tensor:
        """The rows' token ids: stage 0's inputs are the ids; later stages got them in the frame."""
        if self.is_first:
            return inputs if not self.private or self.stage.passes_ids else None
        parts = [w.ids for w in work]
        if any(
            p is None for p in parts
        ):  # a private mesh's: no ids travel where no layer needs them
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type,return-value]

    def _closed(self, request: int) -> None:
        self.closed[request] = None
        if self.masks is not None:
            self.masks.forget(request)
        if len(self.closed) > RECENTLY_CLOSED:
            del self.closed[next(iter(self.closed))]

    def _check_row(self, row: Row) -> StageSequence:
        seq = self.sequences.get(row.request)
        if seq is None:
            raise OutOfStep(f"request {row.request} is not open on this stage")
        if seq.drawing is None and self.source is not None:
            seq.drawing = self.source.drawing(row.request)
        if seq.drawing is None:
            raise OutOfStep(f"request {row.request} is not open on stage 0 here")
        if (
            row.position == 0
            and row.flags & RowFlag.FIRST
            and row.hash_before == EMPTY_HASH
            and seq.next_position
        ):
            self._start_over(seq)  # stage 0 preempted it and computes it again
        if row.position < seq.next_position and seq.resumes_window(row, self.hash_key):
            seq.rewind(row.position, row.hash_before)  # the drafts after it were rejected
        if row.position != seq.next_position or row.hash_before != seq.hash:
            raise OutOfStep(
                f"request {row.request}: frame at position {row.position} (prefix {row.hash_before:016x}) "
                f"but this stage is at {seq.next_position} (prefix {seq.hash:016x})"
            )
        if seq.done:
            raise OutOfStep(f"request {row.request} has already finished")
        return seq

    def _ended_before(self, row: Row) -> bool:
        """A window sent on after one that ended its sequence (a stale window): expected, so
        dropped without a warning."""
        seq = self.sequences.get(row.request)
        return bool(row.flags & RowFlag.FOLLOW) and (seq is None or seq.done)

    def _start_over(self, seq: StageSequence) -> None:
        self.stage.release_cache(seq.cache)
        seq.cache = self.stage.new_cache(seq.drawing is not None and seq.drawing.params.argmax_only)
        seq.next_position, seq.hash, seq.done, seq.output = 0, EMPTY_HASH, False, []

    def _sample(self, w: Work, logits: torch.Tensor) -> list[TokenRow]:
        """The row's draws (``draw_row``), with what its request generated so far where its
        sampling reads it."""
        seq = self.sequences.get(w.row.request)
        params = w.drawing.params
        needs_output = params.penalised or bool(params.grammar)
        output = self._output(w.row.request, seq, w.drawing) if needs_output else []
        if needs_output and seq is not None and self.head is None and self.source is None:
            drafts = len(w.token_ids()[1:]) if w.row.flags & RowFlag.WINDOW else 0
            output = output[: len(output) - drafts]  # a later stage read the drafts as output too
        return draw_row(
            w,
            logits,
            seq,
            output,
            self.masks,
            self.hash_key,
            lambda exc: self._failed(seq, w.row.request, exc),
        )

    def _stale(self, w: Work) -> bool:
        """Whether ``w`` is a window that went on from one not accepted whole (or from another
        draw than its first token): the last stage neither computes nor draws from it, and the
        sequence's next row goes back before it, where its positions are written again."""
        if not w.row.flags & RowFlag.FOLLOW:
            return False
        seq = self.sequences.get(w.row.request)
        stale = seq is None or seq.done or seq.drew != (w.row.position, w.token_ids()[0])
        self.stale_windows += stale
        return stale

    def _failed(self, seq: StageSequence | None, request: int, exc: RequestError) -> None:
        if seq is not None:
            seq.done = True
        if self.links.failed is not None:
            self.links.failed([request], exc)

    def _output(self, request: int, seq: StageSequence | None, drawing: Drawing) -> list[int]:
        """What the request generated so far: stage 0's scheduler knows; a later stage read it."""
        if self.head is not None or self.source is not None:
            return (self.head or self.source).output(request, drawing)  # type: ignore[union-attr]
        return seq.output if seq is not None else []


def _nbytes(caches: list[Any]) -> int:
    return sum(c.nbytes() for c in caches if hasattr(c, "nbytes"))


def _stripped(msg: Message) -> Message:
    """What a private mesh's stage 0 tells the members of a request: that it is open, and its
    lengths (its rows show them anyway), not how it samples (token ids: bias, stops, grammar)."""
    if isinstance(msg, Open):
        return Open(
            request=msg.request,
            sampling=SamplingParams(),
            prompt_len=msg.prompt_len,
            context_length=msg.context_length,
        )
    return msg
