"""The engine core: one step is schedule → executor.run → record.

The scheduler plans (admission, preemption, the batch's rows) and records what was drawn; it
runs no model. An executor runs a batch: ``LocalExecutor`` on a stage in this process that
owns the embedding and the head (one forward, then a draw after each row that ends in one,
by the one sampler and finish rule), giving back what it drew; a pipeline's stage 0
(``PipelineHead``) sends the rows downstream instead, and the tokens are recorded when the
last stage returns them. ``Engine.generate``, ``serve --single``'s batch loop and a mesh's
stage 0 all run this step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from seamline.errors import RequestError
from seamline.model.cache import logit_rows, logits_by_span
from seamline.model.devices import to_host
from seamline.model.stage import Stage
from seamline.runtime.cuda_graphs import GraphedDecode
from seamline.runtime.grammar import TokenMasks, grammar_mask
from seamline.runtime.sampling import TokenEvent, draw_next
from seamline.runtime.scheduler import Batch, Emission, ReadyCheck, Scheduler, SequenceState
from seamline.runtime.speculation import draws_while_accepted

if TYPE_CHECKING:
    from seamline.runtime.group_stage import LockstepStage


class Executor(Protocol):
    def run(self, batch: Batch) -> list[Emission]: ...


class LocalExecutor:
    """Runs a batch on a stage in this process that owns the embedding and the head."""

    def __init__(
        self, stage: Stage | LockstepStage, context_length: int, masks: TokenMasks | None = None
    ) -> None:
        if stage.head is None:
            raise ValueError("a local executor draws: its stage must own the head")
        self.stage = stage
        self.context_length = context_length
        self.masks = masks  # a grammar's tokens, where this process has the tokenizer
        self.decode_steps = 0  # forwards of decode rows only, and the seconds they took
        self.decode_seconds = 0.0
        self.graphs = GraphedDecode.for_stage(
            stage, context_length
        )  # decode steps as CUDA graphs, on a GPU

    def run(self, batch: Batch) -> list[Emission]:
        """One forward over the batch; a token drawn after each row that ends in a draw, and
        after each row of a speculative window while its drafts are accepted."""
        started = time.perf_counter()
        logits = self._logits(batch)
        if all(span.count == 1 for span in batch.spans):  # decode rows only
            self.decode_steps += 1
            self.decode_seconds += time.perf_counter() - started
        emissions: list[Emission] = []
        for sequence, draws, rows in zip(
            batch.owners, batch.draws, logits_by_span(batch.spans, logits)
        ):
            if draws:
                emissions += self._draw_window(sequence, rows)
        return emissions

    def _logits(self, batch: Batch) -> torch.Tensor:
        """The step's logits, on the host (a GPU stage's one crossing out): from a replayed CUDA
        graph where one covers the step (decode rows only), else from an eager forward."""
        if self.graphs is not None and all(
            span.count == 1 and not span.rowwise for span in batch.spans
        ):
            replayed = self.graphs.run(batch.inputs, batch.spans)
            if replayed is not None:
                return to_host(replayed)
        inputs = torch.tensor(batch.inputs, dtype=torch.long)
        if any(span.rowwise for span in batch.spans):
            return to_host(
                self.stage.forward_batch(inputs, batch.spans, logit_rows=logit_rows(batch.spans))
            )  # type: ignore[call-arg]
        return to_host(self.stage.forward_batch(inputs, batch.spans, last_only=True))

    def _draw_window(self, sequence: SequenceState, rows: torch.Tensor) -> list[Emission]:
        """The draws after a sequence's rows [1 + drafts, vocab] (``draws_while_accepted``)."""
        drafts = sequence.drafter.window if sequence.drafter is not None else []
        emissions: list[Emission] = []

        def draw(logits: torch.Tensor, generated: list[int]) -> TokenEvent | None:
            emissions.append(self._draw(sequence, logits, generated))
            return emissions[-1].event

        draws_while_accepted(rows, drafts, sequence.tokens, draw)
        return emissions

    def _draw(
        self, sequence: SequenceState, logits: torch.Tensor, generated: list[int]
    ) -> Emission:
        position = len(sequence.prompt) + len(generated)
        try:
            allowed = grammar_mask(
                self.masks, sequence.id, sequence.params, generated, logits.shape[-1]
            )
        except RequestError as exc:  # this sequence alone ends
            return Emission(sequence, None, None, exc)
        event = draw_next(
            logits,
            sequence.params,
            sequence.seed,
            position,
            generated,
            allowed,
            len(sequence.prompt),
            self.context_length,
        )
        return Emission(sequence, event, logits)


class EngineCore:
    """A scheduler and the executor that runs its batches."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        after_step: Callable[[Batch], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.after_step = (
            after_step  # once a step's tokens are recorded (a model's drafts for the next)
        )

    @classmethod
    def local(
        cls,
        stage: Stage | LockstepStage,
        context_length: int,
        masks: TokenMasks | None = None,
        **scheduler_options: Any,
    ) -> EngineCore:
        """The core of one process that owns the whole model."""
        scheduler = Scheduler(stage, context_length, masks=masks, **scheduler_options)
        after_step = None
        if (
            getattr(stage, "mtp", None) is not None
            and scheduler.speculation is not None
            and scheduler.speculation.mode == "mtp"
        ):
            from seamline.runtime.mtp_drafts import offer_drafts

            after_step = partial(offer_drafts, stage)
        return cls(scheduler, LocalExecutor(stage, context_length, masks), after_step)

    def step(
        self, ready: ReadyCheck | None = None, max_decode_rows: int | None = None
    ) -> list[Emission] | None:
        """Plan a batch, run it, record what it drew; None when there was nothing to run."""
        batch = self.scheduler.next_batch(ready, max_decode_rows)
        if not batch.spans:
            return None
        self.scheduler.advance(batch)
        emissions = [self._record(emission) for emission in self.executor.run(batch)]
        if self.after_step is not None:
            self.after_step(batch)
        return emissions

    def _record(self, emission: Emission) -> Emission:
        if emission.error is not None:
            return self.scheduler.fail(emission.sequence, emission.error)
        assert emission.event is not None  # an executor's emission holds a token or an error
        return self.scheduler.record(emission.sequence, emission.event, emission.logits)
