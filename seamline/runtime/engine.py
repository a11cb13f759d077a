"""Engine: token ids in, token ids out, on one process that owns the whole model.

``generate`` runs the scheduler's loop for one sequence (the loop a server batches many
requests with); ``decode_loop`` is the lockstep group's own loop, still apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from seamline.model.stage import Stage
from seamline.runtime.sampling import SamplingParams, request_seed, sample
from seamline.runtime.scheduler import Scheduler, check_prompt

PREFILL_CHUNK = 512


class Engine:
    def __init__(self, stage: Stage, context_length: int | None = None) -> None:
        if stage.embed is None or stage.head is None:
            raise ValueError("Engine needs a stage that owns the embedding and the head")
        self.stage = stage
        self.config = stage.config
        self.context_length = context_length or self.config.max_position_embeddings

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
        """Yield generated token ids until a stop token, max_tokens, or the context is full:
        the scheduler's loop (the one a server batches many requests with), for one sequence."""
        params.validate()
        self.check_prompt(prompt)
        scheduler = Scheduler(self.stage, self.context_length, max_step_tokens=PREFILL_CHUNK)
        sequence = scheduler.add(prompt, params)
        while not sequence.finished:
            for emission in scheduler.step():
                if emission.token is not None:
                    yield emission.token


def decode_loop(
    logits: torch.Tensor,
    position: int,
    params: SamplingParams,
    context_length: int,
    step: Callable[[int, int], torch.Tensor],
) -> Iterator[int]:
    """Sample, yield, and ``step(token, position)`` to the next logits until a stop token,
    ``max_tokens`` or the end of the context: the one generation loop every runtime shares."""
    seed = request_seed(params.seed)
    stops = set(params.stop_token_ids)
    for _ in range(params.max_tokens):
        token = sample(logits, params, seed, position)
        if token in stops:
            return
        yield token
        if position + 1 >= context_length:
            return
        logits = step(token, position)
        position += 1
