"""Continuous batching over one stage that owns the embedding and the head.

A step carries the decode row of every sequence past its prompt, then chunks of the prompts
still being prefilled, first come first served, up to ``max_step_tokens`` rows; one forward
(``Stage.forward_batch``) runs them all. Sequences join and leave at step boundaries: a
waiting sequence is admitted, in arrival order, when fewer than ``max_running`` hold a cache
and the KV memory it may grow to (prompt + max_tokens, within the context) fits in what the
running ones leave of ``kv_budget_bytes``; a finished one frees its cache at once. A request
that could not fit even alone is refused when it is added, and so is one that finds
``max_waiting`` requests already queued (``OverloadedError``: HTTP 429). A draw depends only on the
sequence's seed and position, so a seeded sequence draws the same tokens whatever shares its
steps.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from seamline.errors import OverloadedError, RequestError
from seamline.mesh.types import kv_bytes_per_token
from seamline.model.cache import SequenceCache, Span
from seamline.model.stage import Stage
from seamline.runtime.sampling import SamplingParams, request_seed, sample

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's state: its prompt, what it generated, how much of it the cache holds."""

    prompt: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)  # generated (a stop token is not kept)
    prefilled: int = 0  # prompt tokens in the cache
    samples: int = 0  # tokens drawn, a stop token included: max_tokens counts these
    finish_reason: str | None = None  # "stop" or "length" once finished
    cache: SequenceCache | None = None
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        self.seed = request_seed(self.params.seed)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

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
        stage: Stage,
        context_length: int,
        max_step_tokens: int = 512,
        max_running: int = 64,
        kv_budget_bytes: int | None = None,
        max_waiting: int = 256,
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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def kv_reserve(self, sequence: Sequence) -> int:
        """The KV bytes ``sequence`` may grow to: prompt + max_tokens, within the context."""
        tokens = min(len(sequence.prompt) + sequence.params.max_tokens, self.context_length)
        return tokens * self.kv_bytes_per_token

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
        spans, inputs, owners = self._plan()
        if not spans:
            return []
        logits = self.stage.forward_batch(torch.tensor(inputs, dtype=torch.long), spans, last_only=True)
        emitted = []
        for row, (sequence, span) in enumerate(zip(owners, spans)):
            if sequence.prefilling:
                sequence.prefilled += span.count
                if sequence.prefilling:
                    continue  # a chunk short of the prompt's end: no token yet
            emitted.append(self._draw(sequence, logits[row]))
        return emitted

    def _admit(self) -> None:
        used = sum(self.kv_reserve(s) for s in self.running)
        while self.waiting and len(self.running) < self.max_running:
            if self.kv_budget_bytes is not None and used + self.kv_reserve(self.waiting[0]) > self.kv_budget_bytes:
                return  # the head of the queue waits for memory; later ones wait behind it (FCFS)
            sequence = self.waiting.popleft()
            used += self.kv_reserve(sequence)
            sequence.cache = self.stage.new_cache(greedy=sequence.params.greedy)
            self.running.append(sequence)

    def _plan(self) -> tuple[list[Span], list[int], list[Sequence]]:
        """Decode rows first (one each), then prompt chunks in arrival order, within the budget."""
        spans: list[Span] = []
        inputs: list[int] = []
        owners: list[Sequence] = []
        decoding = [s for s in self.running if not s.prefilling]
        for sequence in decoding + [s for s in self.running if s.prefilling]:
            if sequence.prefilling:
                count = min(len(sequence.prompt) - sequence.prefilled, self.max_step_tokens - len(inputs))
                start, rows = sequence.prefilled, sequence.prompt[sequence.prefilled : sequence.prefilled + count]
            else:
                count, start, rows = 1, len(sequence.prompt) + len(sequence.tokens) - 1, sequence.tokens[-1:]
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
            self.stage.release_cache(sequence.cache)
            sequence.cache = None
