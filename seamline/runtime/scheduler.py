"""Continuous batching over one stage that owns the embedding and the head.

A step carries the decode row of every sequence past its prompt, then chunks of the prompts
still being prefilled, first come first served, up to ``max_step_tokens`` rows; one forward
(``Stage.forward_batch``) runs them all. Sequences join and leave at step boundaries: a
waiting sequence is admitted, in arrival order, when fewer than ``max_running`` hold a cache
and the KV memory it will hold after its next step (a position per token it knows) fits in what the
running ones leave of ``kv_budget_bytes``; a finished one frees its cache at once.

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
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from seamline.errors import OverloadedError, RequestError
from seamline.config import kv_bytes_per_token
from seamline.model.cache import SequenceCache, Span
from seamline.model.stage import Stage
from seamline.runtime.prefix_cache import PrefixCache, common_prefix
from seamline.runtime.sampling import SamplingParams, request_seed, sample

if TYPE_CHECKING:
    from seamline.runtime.group_stage import GroupCache, LockstepStage

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's state: its prompt, what it generated, how much of it the cache holds."""

    prompt: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)  # generated (a stop token is not kept)
    cached: int = 0  # positions the cache holds: the prompt's, then the generated tokens
    samples: int = 0  # tokens drawn, a stop token included: max_tokens counts these
    finish_reason: str | None = None  # "stop" or "length" once finished
    cache: SequenceCache | GroupCache | None = None
    seed: int = field(init=False)

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
        return (self.prompt + self.tokens)[start:end] if end > len(self.prompt) else self.prompt[start:end]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Emission:
    """What a step gave one sequence: a token (None when it drew a stop token) and the logits
    [vocab] it was drawn from."""

    sequence: Sequence
    token: int | None
    logits: torch.Tensor


def check_prompt(prompt: list[int], context_length: int) -> None:
    if not prompt:
        raise RequestError("the prompt is empty")
    if len(prompt) >= context_length:
        raise RequestError(f"the prompt has {len(prompt)} tokens; the model's context is {context_length}")


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
    ) -> None:
        if stage.embed is None or stage.head is None:
            raise ValueError("the scheduler needs a stage that owns the embedding and the head")
        self.stage = stage
        self.context_length = context_length
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        self.kv_budget_bytes = kv_budget_bytes
        self.max_waiting = max_waiting
        dtype_bytes = torch.finfo(stage.compute_dtype).bits // 8
        self.kv_bytes_per_token = kv_bytes_per_token(stage.config, dtype_bytes) * len(stage.layers)
        self.prefix = PrefixCache(prefix_cache_bytes, self.kv_bytes_per_token, stage.release_cache)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # sequences sent back to the queue to free memory, so far

    def kv_reserve(self, sequence: Sequence) -> int:
        """The KV bytes ``sequence`` may grow to: prompt + max_tokens, within the context."""
        tokens = min(len(sequence.prompt) + sequence.params.max_tokens, self.context_length)
        return tokens * self.kv_bytes_per_token

    def kv_held(self, sequence: Sequence) -> int:
        """The KV bytes ``sequence`` holds once its next step is done: a position for every
        token it knows (the prompt, or its last generated token, computed by that step)."""
        tokens = min(len(sequence.prompt) + len(sequence.tokens), self.context_length)
        return tokens * self.kv_bytes_per_token

    def kv_used(self) -> int:
        return sum(self.kv_held(s) for s in self.running) + self.prefix.held_bytes()

    def add(self, prompt: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; it joins at the next step with room."""
        params.validate()
        check_prompt(prompt, self.context_length)
        if len(self.waiting) >= self.max_waiting:
            raise OverloadedError(f"{len(self.waiting)} requests are already waiting; try again later")
        sequence = Sequence(list(prompt), params)
        need = self.kv_reserve(sequence)
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise RequestError(
                f"the request may need {need / 2**20:.1f} MiB of KV cache (prompt + max_tokens); "
                f"this node has {self.kv_budget_bytes / 2**20:.1f} MiB: shorten the prompt or lower max_tokens"
            )
        self.waiting.append(sequence)
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """Drop a sequence wherever it is (a client went away); its cache is freed."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        self._release(sequence, sequence.finish_reason or "abort")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> list[Emission]:
        """One forward over every running sequence's next rows; the tokens it gave."""
        self._admit()
        self._make_room()
        spans, inputs, owners = self._plan()
        if not spans:
            return []
        logits = self.stage.forward_batch(torch.tensor(inputs, dtype=torch.long), spans, last_only=True)
        emitted = []
        for row, (sequence, span) in enumerate(zip(owners, spans)):
            computing = sequence.prefilling
            sequence.cached += span.count
            if computing and (sequence.prefilling or sequence.tokens):
                continue  # a chunk short of the prompt's end, or recomputed history: no draw
            emitted.append(self._draw(sequence, logits[row]))
        return emitted

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            if any(r.prompt == head.prompt and r.prefilling for r in self.running):
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

    def _make_room(self) -> None:
        """Preempt the newest running sequences until the next step fits the budget."""
        while len(self.running) > 1 and not self._fits(0):
            victim = self.running.pop()
            self.stage.release_cache(victim.cache)  # type: ignore[arg-type]
            victim.cache, victim.cached = None, 0
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def _start(self, sequence: Sequence) -> None:
        """A cache for a newly admitted sequence: a copy of the longest shared prefix, if any."""
        # a fresh prompt needs the logits of its last token; recomputed history, every position
        limit = sequence.prefill_end if sequence.tokens else len(sequence.prompt) - 1
        wanted = sequence.known(0, limit)
        donor, shared = self.prefix.best(wanted)
        for other in self.running:
            if other.cache is not None and (n := common_prefix(other.known(0, other.cached), wanted)) > shared:
                donor, shared = other.cache, n
        if isinstance(donor, SequenceCache) and shared > 0:  # a lockstep group's caches are not copied
            sequence.cache, sequence.cached = donor.fork(shared), shared
        else:
            sequence.cache, sequence.cached = self.stage.new_cache(greedy=sequence.params.greedy), 0

    def _plan(self) -> tuple[list[Span], list[int], list[Sequence]]:
        """Decode rows first (one each), then prompt chunks in arrival order, within the budget."""
        spans: list[Span] = []
        inputs: list[int] = []
        owners: list[Sequence] = []
        decoding = [s for s in self.running if not s.prefilling]
        for sequence in decoding + [s for s in self.running if s.prefilling]:
            start = sequence.cached
            if sequence.prefilling:
                count = min(sequence.prefill_end - start, self.max_step_tokens - len(inputs))
                rows = sequence.known(start, start + count)
            else:
                count, rows = 1, sequence.tokens[-1:]
            if count <= 0 or (spans and len(inputs) + count > self.max_step_tokens):
                break
            assert sequence.cache is not None
            spans.append(Span(len(inputs), count, start, sequence.cache))
            inputs += rows
            owners.append(sequence)
        return spans, inputs, owners

    def _draw(self, sequence: Sequence, logits: torch.Tensor) -> Emission:
        token = sample(logits, sequence.params, sequence.seed, len(sequence.prompt) + len(sequence.tokens))
        sequence.samples += 1
        if token in sequence.params.stop_token_ids:
            self._release(sequence, "stop")
            return Emission(sequence, None, logits)
        sequence.tokens.append(token)
        full = len(sequence.prompt) + len(sequence.tokens) >= self.context_length
        if sequence.samples >= sequence.params.max_tokens or full:
            self._release(sequence, "length")
        return Emission(sequence, token, logits)

    def _release(self, sequence: Sequence, reason: str) -> None:
        sequence.finish_reason = reason
        if sequence in self.running:
            self.running.remove(sequence)
        if sequence.cache is not None:
            if self.prefix.capacity_bytes > 0 and sequence.cached > 0:
                self.prefix.put(sequence.known(0, sequence.cached), sequence.cache, sequence.cached)
            else:
                self.stage.release_cache(sequence.cache)
            sequence.cache = None
