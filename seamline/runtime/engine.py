"""Engine: token ids in, token ids out, on one process that owns the whole model.

``generate`` runs the scheduler's loop for one sequence (the loop a server batches many
requests with), over a Stage or a lockstep group that owns the whole model (LockstepStage).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from seamline.model.stage import Stage
from seamline.params import SamplingParams
from seamline.runtime.core import EngineCore
from seamline.runtime.grammar import TokenMasks
from seamline.runtime.sampling import TokenEvent
from seamline.runtime.scheduler import check_prompt
from seamline.runtime.speculation import OFF, Speculation

if TYPE_CHECKING:
    from seamline.runtime.group_stage import LockstepStage

PREFILL_CHUNK = 512


class Engine:
    def __init__(self, stage: Stage | LockstepStage, context_length: int | None = None) -> None:
        if stage.embed is None or stage.head is None:
            raise ValueError("Engine needs a stage that owns the embedding and the head")
        self.stage = stage
        self.config = stage.config
        self.context_length = context_length or self.config.max_position_embeddings
        self.masks: TokenMasks | None = (
            None  # set where the tokenizer is known: requests may carry a grammar
        )
        self.speculation: Speculation = (
            OFF  # drafts verified in the decode steps (``runtime/speculation.py``)
        )

    def check_prompt(self, prompt: list[int]) -> None:
        check_prompt(prompt, self.context_length)

    def prefill(self, prompt: list[int], cache: object) -> torch.Tensor:
        """Run the prompt in chunks; return the logits of its last position."""
        ids = torch.tensor(prompt, dtype=torch.long)
        logits = torch.empty(0)
        for start in range(0, len(prompt), PREFILL_CHUNK):
            chunk = ids[start : start + PREFILL_CHUNK]
            logits = self.stage(chunk, start, cache, last_only=True)
        return logits[-1]

    def generate(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated token ids until a stop token, max_tokens, or the context is full."""
        return (event.token for event in self.events(prompt, params) if event.shown)

    def events(self, prompt: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Every token drawn, with its log-probabilities if asked, the last with why the request
        ended (a stop token's event is not output): the scheduler's loop (the one a server
        batches many requests with), for one sequence."""
        params.validate()
        self.check_prompt(prompt)
        core = EngineCore.local(
            self.stage,
            self.context_length,
            self.masks,
            max_step_tokens=PREFILL_CHUNK,
            speculation=self.speculation,
        )
        sequence = core.scheduler.add(prompt, params)
        try:
            while not sequence.finished:
                for emission in core.step() or ():
                    if emission.error is not None:
                        raise emission.error
                    assert emission.event is not None
                    yield emission.event
        finally:
            if not sequence.finished:  # the caller stopped early: free the cache
                core.scheduler.cancel(sequence)
