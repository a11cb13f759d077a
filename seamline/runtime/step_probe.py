"""A loaded stage's speed probe: the seconds of one step of 1, 8, 16, 32 and 64 decode rows, and of
one step of each of ``PROMPT_ROWS`` prompt rows (new sequences' chunks).

Taken once, after the stage loads and before it serves, on sequences ``PROBE_DEPTH`` positions
deep (copies of one prefilled cache), so that each row also attends over a chat turn's context:
the cost model (``seamline.sim``) prices a step of any row count from these, with the
per-layer overhead, the attention and the batched kernels' gain that a bare weight-streaming
rate leaves out.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from seamline.model.stage import Stage
    from seamline.runtime.group_stage import LockstepStage

# 8 and 32: two stages' micro-batches at 16 and 64 clients (8 rows took 34 ms here where the rate
# interpolated between 1 and 16 rows gave 42)
PROBE_ROWS = (1, 8, 16, 32, 64)
PROBE_DEPTH = 160  # positions: a prompt of 32-256 tokens part-way through its answer
# a step's prompt rows, as new sequences' chunks of at most PROMPT_CHUNK rows: one short prompt,
# one chunk, and a full step of four (a loaded stage's: 512 rows of a pipeline's 128-row chunks).
# Per row, 32 rows took 1.6x what four chunks of 128 did here, one chunk of 256 1.1x, of 512 1.3x:
# a chunk's rows attend over each other, and the matmuls gain with the step's rows
PROMPT_ROWS = (32, 128, 512)
PROMPT_CHUNK = 128
# the median of these: a served step is a typical one (the fastest of five read 3-6% under the
# median of a stream's served steps here); a probe taken beside a neighbour's burst is taken
# again once the cores are quiet, where a node asks for it (``mesh.node.reprobe``)
REPEATS = 5


class NotProbed(Exception):
    """A stage whose inputs or cache the probe cannot build."""


@torch.inference_mode()
def probe_steps(
    stage: Stage | LockstepStage,
    rows: tuple[int, ...] = PROBE_ROWS,
    repeats: int = REPEATS,
    depth: int = PROBE_DEPTH,
    lock: AbstractContextManager = nullcontext(),
) -> dict[int, float]:
    """Per row count, the median of ``repeats`` steps of that many one-row spans (one sequence
    each, ``depth`` positions in), as a decode step runs them; the stage's inputs are token ids
    or hidden states as it takes them. A lockstep group's steps run through the whole group:
    every rank's shard and the gates between them. Each forward holds ``lock`` (a serving
    stage's: its requests' forwards wait for one probe forward at most)."""
    if getattr(stage, "passes_ids", False) or not stage.forks_caches:
        raise NotProbed(
            "the probe takes one hidden row per token and copies of one cache; this stage "
            "(DeepSeek-V4's hyper-connected residual and compressed caches) has neither"
        )
    prefilled = stage.new_cache()
    try:
        with lock:
            stage.forward(_inputs(stage, depth), 0, prefilled, last_only=True)
        return {
            count: _typical_step(stage, prefilled, count, repeats, depth, lock) for count in rows
        }
    finally:
        stage.release_cache(prefilled)


def _typical_step(
    stage: Stage | LockstepStage,
    prefilled: Any,
    count: int,
    repeats: int,
    depth: int,
    lock: AbstractContextManager,
) -> float:
    from seamline.model.cache import Span

    caches = [prefilled.fork(depth) for _ in range(count)]
    try:
        inputs = _inputs(stage, count)
        seconds = []
        for step in range(repeats + 1):
            spans = [Span(i, 1, depth + step, cache) for i, cache in enumerate(caches)]
            seconds.append(_timed(lock, lambda: stage.forward_batch(inputs, spans, last_only=True)))  # noqa: B023 (called at once)
        return statistics.median(seconds[1:])  # the first warms the row count's buffers up
    finally:
        for cache in caches:  # a lockstep group's live on every rank until released
            stage.release_cache(cache)


@torch.inference_mode()
def probe_prompt(
    stage: Stage | LockstepStage,
    rows: tuple[int, ...] = PROMPT_ROWS,
    repeats: int = REPEATS,
    lock: AbstractContextManager = nullcontext(),
    chunk: int = PROMPT_CHUNK,
) -> dict[int, float]:
    """Per count in ``rows``, the median of ``repeats`` steps of that many prompt rows: new
    sequences' first chunks of at most ``chunk`` rows each (a step of more rows holds several)."""
    return {count: _typical_prompt_s(stage, _chunks(count, chunk), repeats, lock) for count in rows}


def _chunks(rows: int, chunk: int) -> list[int]:
    whole, rest = divmod(rows, chunk)
    return [chunk] * whole + ([rest] if rest else [])


def _typical_prompt_s(
    stage: Stage | LockstepStage, chunks: list[int], repeats: int, lock: AbstractContextManager
) -> float:
    inputs = _inputs(stage, sum(chunks))
    return statistics.median(
        [_new_prompts_s(stage, inputs, chunks, lock) for _ in range(repeats + 1)][1:]
    )


def _new_prompts_s(
    stage: Stage | LockstepStage,
    inputs: torch.Tensor,
    chunks: list[int],
    lock: AbstractContextManager,
) -> float:
    from seamline.model.cache import Span

    caches = [stage.new_cache() for _ in chunks]
    try:
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        spans = [
            Span(start, count, 0, cache) for start, count, cache in zip(starts, chunks, caches)
        ]
        return _timed(lock, lambda: stage.forward_batch(inputs, spans, last_only=True))
    finally:
        for cache in caches:
            stage.release_cache(cache)


def _timed(lock: AbstractContextManager, forward: Callable[[], object]) -> float:
    """The wall seconds of ``forward()``, run holding ``lock`` (the wait for it not counted)."""
    with lock:
        started = time.perf_counter()
        forward()
        return time.perf_counter() - started


def _inputs(stage: Stage | LockstepStage, count: int) -> torch.Tensor:
    if stage.embed is not None:
        return torch.full((count,), 1, dtype=torch.long)
    generator = torch.Generator().manual_seed(count)
    hidden = torch.randn(count, stage.config.hidden_size, generator=generator)
    return hidden.to(stage.compute_dtype)
