"""Continuous batching: the plan of each step over a stage that owns the embedding, and the
record of what was drawn. It runs no model: the engine core (``runtime/core.py``) runs each
batch it plans with an executor, then records the tokens here.

A step carries the decode row of every sequence past its prompt, then chunks of the prompts
still being prefilled, first come first served, up to ``max_step_tokens`` rows (and at most
``prefill_chunk`` rows of one prompt, where set: a pipeline's stage 0 sends a long prompt on
in several chunks, so that the later stages compute one while it computes the next); one forward
(``Stage.forward_batch``, in the executor) runs them all. Sequences join and leave at step boundaries: a
waiting sequence is admitted, in arrival order, when fewer than ``max_running`` hold a cache
and the KV memory it will hold after its next step fits in what the running ones leave of
``kv_budget_bytes``; a finished one frees its cache at once. Memory is counted as allocated: a
cache's buffers hold at least 256 positions and double as they grow (``model/cache.grown``),
never past the sequence's prompt + max_tokens, and the budget counts those buffers, so that it
bounds the memory the caches take however short the sequences.

Preemption. Running sequences grow a position per step; when the next step would not fit the
budget, the newest running sequence is preempted (as vLLM's recompute): its cache is freed and
it goes back to the head of the queue with what it generated; readmitted, it recomputes its
prompt and its tokens but the last (no draw: that token is known) and decodes on. A draw
depends only on the sequence's seed and position, so its tokens are those of a run that was
never preempted, and a seeded sequence draws the same tokens whatever shares its steps. A
request that could not fit even alone (prompt + max_tokens) is refused when it is added, so
the oldest running sequence always fits; so is one that finds ``max_waiting`` requests already
queued (``OverloadedError``: HTTP 429).

Prefix caching. A sequence admitted with a prompt that begins as a running sequence's known
tokens (or a recently finished one's, kept in ``prefix_cache`` up to ``prefix_cache_bytes``
within the budget) starts from a copy of that cache's common positions and computes only the
rest, as vLLM's automatic prefix caching and llama.cpp's prompt cache do. A sequence whose
whole prompt another running sequence is still prefilling waits for it (``n`` > 1 choices share
one prefill).

Speculation (``runtime/speculation.py``). With a ``Speculation`` on, a decoding sequence's row
may carry drafted tokens after its last one (a window): ``advance`` counts only the last
token's position as cached, ``record`` counts each draft its draw accepted, and the first
draw that differs closes the window; the positions of rejected drafts are written over later.
Drafts fill only rows a step has to spare and positions the cache's buffers already hold, so
they neither take memory the budget did not count nor crowd other sequences' rows out.

The same scheduler drives a pipeline from its stage 0 (``PipelineHead``): ``next_batch`` plans
only sequences that are ``ready`` (no token being drawn downstream), ``advance`` marks the rows
run, ``record`` takes a token drawn by the last stage, and ``on_free`` tells it which caches the
later stages must free too.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from seamline.config import kv_bytes_per_token
from seamline.errors import OverloadedError, RequestError
from seamline.model.cache import SequenceCache, Span, grown
from seamline.model.linear import rows_computed_alike
from seamline.model.stage import Stage
from seamline.params import SamplingParams
from seamline.runtime.grammar import TokenMasks
from seamline.runtime.prefix_cache import PrefixCache, common_prefix
from seamline.runtime.sampling import TokenEvent, request_seed
from seamline.runtime.speculation import (
    SPARE_STEP_ROWS,
    Drafter,
    Speculation,
    SpeculationStats,
    StepCost,
)

if TYPE_CHECKING:
    from seamline.runtime.group_stage import GroupCache, LockstepStage

_ids = itertools.count()


@dataclass(eq=False)
class SequenceState:
    """One request's state: its prompt, what it generated, how much of it the cache holds."""

    prompt: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)  # generated (a stop token is not kept)
    cached: int = 0  # positions the cache holds: the prompt's, then the generated tokens
    samples: int = 0  # tokens drawn, a stop token included: max_tokens counts these
    finish_reason: str | None = None  # "stop" or "length" once finished
    cache: SequenceCache | GroupCache | None = None
    drafter: Drafter | None = None  # its speculation, where it speculates
    donor: SequenceCache | None = (
        None  # the cache its own began as a copy of (None: computed from 0)
    )
    seed: int = field(init=False)
    # where a pipeline's stage 0 (PipelineHead) runs it: its request id on the wire, the prefix
    # hash of the positions stage 0 has run, whether a token for it is being drawn downstream,
    # and the cache its rows went downstream with (the later stages hold a cache of that lineage)
    request: int | None = None
    prefix_hash: int = 0
    in_flight: bool = False
    frame: int = 0  # the stage-0 step whose frame carries its draw, while in flight
    announced: object | None = None
    window_start: int = (
        0  # a window's first position (its last known token) and the prefix hash through it
    )
    window_hash: int = 0
    step_started: float = (
        0.0  # when its last decode rows were planned (0: their tokens are in), how many, and
    )
    step_rows: int = 0  # whether it was the only sequence running then (``Scheduler.step_cost``)
    step_alone: bool = False

    def __post_init__(self) -> None:
        self.seed = request_seed(self.params.seed)

    @property
    def prefilling(self) -> bool:
        """Positions to compute before the next decode row: the prompt; after a preemption,
        the prompt and every generated token but the last."""
        return self.cached < self.prefill_end

    @property
    def prefill_end(self) -> int:
        return len(self.prompt) + max(0, len(self.tokens) - 1)

    def known(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + generated."""
        return (
            (self.prompt + self.tokens)[start:end]
            if end > len(self.prompt)
            else self.prompt[start:end]
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Emission:
    """What a step gave one sequence: the token drawn (with why the sequence ended, on its last)
    and the logits [vocab] it was drawn from (None when another stage drew it)."""

    sequence: SequenceState
    event: TokenEvent | None  # None when the draw failed
    logits: torch.Tensor | None
    error: RequestError | None = None  # the draw failed (a grammar's): this sequence alone ends

    @property
    def token(self) -> int | None:
        """The token as output: None for a stop token (or a failed draw)."""
        return self.event.token if self.event is not None and self.event.shown else None


@dataclass
class Batch:
    """The rows of one forward: each owner's span of ``inputs`` (token ids)."""

    spans: list[Span] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    owners: list[SequenceState] = field(default_factory=list)
    draws: list[bool] = field(
        default_factory=list
    )  # per row, set by ``advance``: a token is drawn after it
    follows: list[bool] = field(
        default_factory=list
    )  # per row: drafts going on from its sequence's window in flight


ReadyCheck = Callable[[SequenceState], bool]


def _always(sequence: SequenceState) -> bool:
    return True


def check_prompt(prompt: list[int], context_length: int) -> None:
    if not prompt:
        raise RequestError("the prompt is empty")
    if len(prompt) >= context_length:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens; the model's context is {context_length}"
        )


class Scheduler:
    def __init__(
        self,
        stage: Stage | LockstepStage,
        context_length: int,
        max_step_tokens: int = 512,
        max_running: int = 64,
        kv_budget_bytes: int | None = None,
        max_waiting: int = 256,
        prefix_cache_bytes: int = 0,
        forks: bool = True,
        masks: TokenMasks | None = None,
        speculation: Speculation | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        if stage.embed is None:
            raise ValueError("the scheduler needs a stage that owns the embedding")
        self.forks = (
            forks and stage.forks_caches
        )  # whether a new sequence may start from a copy of another's cache
        self.stage = stage
        self.context_length = context_length
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = (
            prefill_chunk  # the most rows of one prompt in a step (None: max_step_tokens)
        )
        self.max_running = max_running
        self.kv_budget_bytes = kv_budget_bytes
        self.max_waiting = max_waiting
        dtype_bytes = torch.finfo(stage.compute_dtype).bits // 8
        self.kv_bytes_per_token = kv_bytes_per_token(stage.config, dtype_bytes) * len(stage.layers)
        self.cache_bytes: Callable[[int], int] = (
            stage.cache_bytes
        )  # what a sequence of so many tokens holds
        self.counts_capacity = isinstance(
            stage, Stage
        )  # its caches are buffers here, bounded per sequence
        self.prefix = PrefixCache(
            prefix_cache_bytes if stage.forks_caches else 0, self.kv_bytes_per_token, self._free
        )
        self.on_free: Callable[[object, bool], None] = lambda cache, for_good: (
            None
        )  # False: preempted
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.preemptions = 0  # sequences sent back to the queue to free memory, so far
        self.masks = masks  # a grammar's tokens: a finished sequence's state there is forgotten
        self.speculation: Speculation | None = None
        self.speculate(speculation)
        self.speculated = SpeculationStats()
        self.step_cost = StepCost()  # what a draft's row costs here, measured

    def speculate(self, speculation: Speculation | None) -> None:
        """Draft for the sequences added from now on (None or off: not), where the stage can
        verify drafts."""
        verifies = (
            getattr(self.stage, "verifies_drafts", False)
            and speculation is not None
            and speculation.enabled
        )
        self.speculation = speculation if verifies else None

    def kv_positions(self, sequence: SequenceState) -> int:
        """The most positions ``sequence`` may need: prompt + max_tokens, within the context
        (its cache never grows past them)."""
        return min(len(sequence.prompt) + sequence.params.max_tokens, self.context_length)

    def kv_reserve(self, sequence: SequenceState) -> int:
        """The KV bytes ``sequence`` may grow to."""
        return self.cache_bytes(self.kv_positions(sequence))

    def kv_held(self, sequence: SequenceState) -> int:
        """The KV bytes ``sequence`` holds once its next step is done, as allocated: its cache's
        buffers grown (by the cache's rule, within the sequence's bound) to a position for every
        token it knows (the prompt, or its last generated token, computed by that step). A
        lockstep group's or DeepSeek-V4's caches, which this process does not allocate as
        buffers it sees, count their tokens."""
        tokens = min(len(sequence.prompt) + len(sequence.tokens), self.context_length)
        if self.counts_capacity:
            cache = sequence.cache
            capacity = cache.capacity() if isinstance(cache, SequenceCache) else 0
            tokens = grown(capacity, tokens, self.kv_positions(sequence))
        return self.cache_bytes(tokens)

    def kv_used(self) -> int:
        return sum(self.kv_held(s) for s in list(self.running)) + self.prefix.held_bytes()

    def add(
        self, prompt: list[int], params: SamplingParams, drawn: Sequence[int] = ()
    ) -> SequenceState:
        """Queue a request, validated where it came in (the API, ``Engine.generate``, stage 0's
        reading of the wire); it joins at the next step with room, or is refused when it could
        never fit or too many wait. ``drawn``: the tokens it drew before (a request resumed on a
        new route), recomputed when it is admitted, as a preempted sequence's are."""
        if len(self.waiting) >= self.max_waiting:
            raise OverloadedError(
                f"{len(self.waiting)} requests are already waiting; try again later"
            )
        sequence = SequenceState(list(prompt), params, tokens=list(drawn))
        if (
            self.speculation is not None and not params.grammar
        ):  # a grammar's matcher follows one token at a time
            sequence.drafter = Drafter(self.speculation.draft_max, self.speculation.source)
        need = self.kv_reserve(sequence)
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise RequestError(
                f"the request may need {need / 2**20:.4g} MiB of KV cache (prompt + max_tokens); "
                f"this node has {self.kv_budget_bytes / 2**20:.4g} MiB: shorten the prompt or lower max_tokens"
            )
        self.waiting.append(sequence)
        return sequence

    def cancel(self, sequence: SequenceState) -> None:
        """Drop a sequence wherever it is (a client went away); its cache is freed."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        self._release(sequence, sequence.finish_reason or "abort")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def next_batch(
        self, ready: ReadyCheck | None = None, max_decode_rows: int | None = None
    ) -> Batch:
        """Admit what fits, preempt what must go, and plan the next rows: a decode row for each
        sequence past its prompt (at most ``max_decode_rows``), then prompt chunks. Only
        sequences that are ``ready`` take part (in a pipeline: those with no draw in flight)."""
        self._admit()
        if not self._make_room(ready or _always):
            return Batch()  # over budget until a sequence in flight comes back
        return self._plan(ready or _always, max_decode_rows)

    def advance(self, batch: Batch) -> None:
        """Count the batch's rows as computed; mark which rows end in a draw."""
        for sequence, span, follow in zip(batch.owners, batch.spans, batch.follows):
            if follow:  # only drafts: no position is known yet, and draws follow the window's
                batch.draws.append(True)
                continue
            computing = sequence.prefilling
            drafts = (
                len(sequence.drafter.window)
                if sequence.drafter is not None and not computing
                else 0
            )
            sequence.cached += (
                span.count - drafts
            )  # a draft's position counts once its draw accepts it
            if sequence.drafter is not None and not computing:
                sequence.step_started, sequence.step_rows = time.perf_counter(), span.count
                sequence.step_alone = len(self.running) == 1
            # a chunk short of the prompt's end, or recomputed history, draws nothing
            batch.draws.append(not (computing and (sequence.prefilling or bool(sequence.tokens))))

    def record(
        self, sequence: SequenceState, event: TokenEvent, logits: torch.Tensor | None = None
    ) -> Emission:
        """Take a token drawn for ``sequence`` (here, or by a pipeline's last stage) with the
        finish reason its draw gave (``draw_next``): a stop token is not kept; either reason
        ends the sequence."""
        sequence.samples += 1
        if event.shown:
            sequence.tokens.append(event.token)
        if sequence.drafter is not None and sequence.drafter.window:
            if event.shown and sequence.drafter.check(event.token):
                sequence.cached += (
                    1  # the draft's row is in the cache, and its logits drew the next token
                )
            else:
                self.speculated.add(*sequence.drafter.close(self.step_cost.row_cost))
        if sequence.step_started and not (sequence.drafter is not None and sequence.drafter.window):
            if sequence.step_alone:  # its step's tokens are all in: what the step cost
                self.step_cost.observe(
                    sequence.step_rows, time.perf_counter() - sequence.step_started
                )
            sequence.step_started = 0.0
        if event.finish_reason is not None:
            self._release(sequence, event.finish_reason)
        return Emission(sequence, event, logits)

    def fail(self, sequence: SequenceState, error: RequestError) -> Emission:
        """A draw for ``sequence`` failed (its grammar's): it alone ends, with ``error``."""
        self._release(sequence, "error")
        return Emission(sequence, None, None, error)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            if self.forks and any(r.prompt == head.prompt and r.prefilling for r in self.running):
                return  # its prompt is being computed: start from that cache once it is
            if not self._fits(self.kv_held(head)):
                return  # the head of the queue waits for memory; later ones wait behind it (FCFS)
            self.waiting.popleft()
            self._start(head)
            self.running.append(head)

    def _fits(self, more: int) -> bool:
        """Whether ``more`` bytes fit the budget, after dropping kept prefixes if need be."""
        if self.kv_budget_bytes is None:
            return True
        while self.kv_used() + more > self.kv_budget_bytes:
            if not self.prefix.evict_oldest():
                return False
        return True

    def _make_room(self, ready: ReadyCheck) -> bool:
        """Preempt the newest ready running sequences until the next step fits the budget;
        False when it cannot fit before a sequence that is not ready comes back."""
        while len(self.running) > 1 and not self._fits(0):
            victims = [
                s for s in self.running[1:] if ready(s) and not (s.drafter and s.drafter.window)
            ]
            if not victims:
                return False
            victim = victims[-1]
            self.running.remove(victim)
            self._free(victim.cache, for_good=False)
            victim.cache, victim.cached = None, 0
            self.waiting.appendleft(victim)
            self.preemptions += 1
        return True

    def _start(self, sequence: SequenceState) -> None:
        """A cache for a newly admitted sequence: a copy of the longest shared prefix, if any."""
        # a fresh prompt needs the logits of its last token; recomputed history, every position
        limit = sequence.prefill_end if sequence.tokens else len(sequence.prompt) - 1
        wanted = sequence.known(0, limit)
        donor, shared = self.prefix.best(wanted)
        for other in self.running:
            if (
                other.cache is not None
                and (n := common_prefix(other.known(0, other.cached), wanted)) > shared
            ):
                donor, shared = other.cache, n
        bound = self.kv_positions(sequence)
        if isinstance(donor, SequenceCache) and not donor.holds(
            shared
        ):  # its sliding layers moved past it
            donor, shared = None, 0
        if (
            self.forks and isinstance(donor, SequenceCache) and shared > 0
        ):  # a lockstep group's are not copied
            sequence.cache, sequence.cached, sequence.donor = (
                donor.fork(shared, bound),
                shared,
                donor,
            )
        else:
            sequence.cache, sequence.cached = (
                self.stage.new_cache(greedy=sequence.params.argmax_only),
                0,
            )
            sequence.donor = None
            if isinstance(sequence.cache, SequenceCache):
                sequence.cache.bound(bound)

    def _plan(self, ready: ReadyCheck, max_decode_rows: int | None) -> Batch:
        """Decode rows first (one each), then prompt chunks in arrival order, within the budget."""
        batch = Batch()
        spans, inputs, owners = batch.spans, batch.inputs, batch.owners
        decoding = [s for s in self.running if not s.prefilling and ready(s)][:max_decode_rows]
        spare = min(SPARE_STEP_ROWS, rows_computed_alike()) - len(decoding)
        for sequence in decoding + [s for s in self.running if s.prefilling and ready(s)]:
            start = sequence.cached
            follow = sequence.drafter is not None and bool(
                sequence.drafter.window
            )  # a window in flight
            if follow:
                rows = self._follow_drafts(
                    sequence, min(spare + 1, self.max_step_tokens - len(inputs))
                )
                if not rows:
                    continue
                start, count = self._follow_start(sequence) - len(rows), len(rows)
                spare -= count - 1
            elif sequence.prefilling:
                room = self.max_step_tokens - len(inputs)
                count = min(sequence.prefill_end - start, room, self.prefill_chunk or room)
                rows = sequence.known(start, start + count)
            else:
                rows = sequence.tokens[-1:] + self._drafts(
                    sequence, min(spare, self.max_step_tokens - len(inputs) - 1)
                )
                count = len(rows)
                spare -= count - 1
            if count <= 0 or (spans and len(inputs) + count > self.max_step_tokens):
                break
            assert sequence.cache is not None
            rowwise = follow or (not sequence.prefilling and count > 1)
            spans.append(Span(len(inputs), count, start, sequence.cache, rowwise=rowwise))
            inputs += rows
            owners.append(sequence)
            batch.follows.append(follow)
        return batch

    def _drafts(self, sequence: SequenceState, spare: int) -> list[int]:
        """Tokens drafted after ``sequence``'s last: within the step's ``spare`` rows, the
        positions its cache's buffers hold, and the tokens it may still draw."""
        if sequence.drafter is None or spare <= 0:
            return []
        next_position = sequence.cached + 1
        # a lockstep group's caches, on its ranks, grow by position as a sequence's next tokens would
        held = (
            sequence.cache.capacity()
            if isinstance(sequence.cache, SequenceCache)
            else self.kv_positions(sequence)
        )
        room = min(
            spare,
            held - next_position,
            sequence.params.max_tokens - sequence.samples - 1,
            self.context_length - next_position - 1,
        )
        return sequence.drafter.propose(
            sequence.prompt + sequence.tokens, room, self.step_cost.row_cost
        )

    @staticmethod
    def _follow_start(sequence: SequenceState) -> int:
        """The position after the drafts of ``sequence``'s window in flight."""
        assert sequence.drafter is not None
        return sequence.cached - sequence.drafter.accepted + len(sequence.drafter.window)

    def _follow_drafts(self, sequence: SequenceState, spare: int) -> list[int]:
        """Drafts that go on from ``sequence``'s window in flight (a pipeline keeps several in
        flight): within the step's ``spare`` rows, the cache's buffers and the tokens it may draw."""
        drafter = sequence.drafter
        if drafter is None or spare <= 0 or not isinstance(sequence.cache, SequenceCache):
            return []
        first = self._follow_start(sequence)
        room = min(
            spare,
            sequence.cache.capacity() - first,
            self.context_length - first - 1,
            sequence.params.max_tokens - sequence.samples - drafter.pending - 1,
        )
        drafts = drafter.follow(
            sequence.prompt + sequence.tokens + drafter.window[drafter.accepted :], room
        )
        self.speculated.follows += bool(drafts)
        return drafts

    def _release(self, sequence: SequenceState, reason: str) -> None:
        sequence.finish_reason = reason
        if sequence.drafter is not None:
            self.speculated.add(*sequence.drafter.close(self.step_cost.row_cost))
        if self.masks is not None:
            self.masks.forget(sequence.id)
        if sequence in self.running:
            self.running.remove(sequence)
        if sequence.cache is not None:
            if self.prefix.capacity_bytes > 0 and sequence.cached > 0:
                self.prefix.put(sequence.known(0, sequence.cached), sequence.cache, sequence.cached)
            else:
                self._free(sequence.cache)
            sequence.cache = None

    def _free(self, cache: object, for_good: bool = True) -> None:
        self.stage.release_cache(cache)  # type: ignore[arg-type]
        self.on_free(cache, for_good)
