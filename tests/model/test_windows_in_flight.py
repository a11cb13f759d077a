"""Windows in flight across a pipeline: while one window of a sequence crosses the stages,
stage 0 sends the next, drafted as if the first is accepted whole (flagged FOLLOW).

Three stages of a random Llama run in one process, wired by links that deliver in order after a
delay, so stage 0 has windows in flight while the later stages work. The drafts are scripted:
right but for a wrong one every so often, so some windows are accepted whole (and windows
follow them), and some are rejected with others in flight after them (stale: every stage
computes them, none draws from them, and the next rows go back to the first rejected position).
The tokens must be those of the pipeline without drafts, and every stage's cache over the
positions the answer holds must equal that run's but for rounding (float32: a matmul of a
window's rows rounds its last bits unlike one row's, ~1e-7; a stale draft's state left behind
would differ by the size of the values).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from seamline.model.cache import SequenceCache
from seamline.net.frames import RowFlag
from seamline.ownership import Ownership
from seamline.params import SamplingParams
from seamline.runtime.speculation import OFF, DraftSource, Speculation
from seamline.weights.loader import load_stage
from tests.support.configs import checkpoint_source
from tests.support.pipeline import Pipeline
from tests.support.speculation import TOKENS, repetitive_prompt

ROUNDING = (
    1e-5  # a window's rows in float32 matmuls of several rows, against one row's: last bits (~1e-7)
)
WRONG_EVERY = 11  # the draft for every 11th generated token is wrong


def _scripted(expected: list[int], prompt_len: int) -> DraftSource:
    def source(history: list[int], limit: int) -> list[int]:
        done = len(history) - prompt_len
        upcoming = expected[done:][:limit]
        return [
            (t + 1) % 256 if (done + i) % WRONG_EVERY == WRONG_EVERY - 1 else t
            for i, t in enumerate(upcoming)
        ]

    return source


def _run(
    stages: list, prompt: list[int], params: SamplingParams, speculation: Speculation
) -> tuple[list[int], list[dict[int, torch.Tensor]], Pipeline]:
    """The tokens, and each stage's cache keys per layer, as the request ends."""
    pipeline = Pipeline(stages, speculation)
    try:
        head = pipeline.workers[0].head
        assert head is not None
        kept: list[SequenceCache] = []
        freeing = head.scheduler.on_free
        head.scheduler.on_free = lambda cache, for_good: (
            kept.append(cache),
            freeing(cache, for_good),
        )  # type: ignore[func-returns-value]
        tokens = pipeline.generate(1, prompt, params)
        later = [
            worker.sequences[1].cache for worker in pipeline.workers[1:]
        ]  # before stage 0 has them forgotten
        deadline = time.monotonic() + 30
        while not kept:  # stage 0 lets go of it once the last token is back there
            assert time.monotonic() < deadline, "stage 0 never freed the finished sequence's cache"
            time.sleep(0.01)
        caches = [kept[-1], *later]
        known = len(prompt) + len(tokens) - 1  # positions computed: all but the last token's
        keys = [{i: kv.k[:, :known].clone() for i, kv in cache.layers.items()} for cache in caches]
        return tokens, keys, pipeline
    finally:
        pipeline.close()


def test_stale_windows_leave_every_stage_as_a_run_that_never_drafted(tmp_path: Path) -> None:
    source = checkpoint_source("dense", tmp_path)
    layers = 3
    stages = [load_stage(source, Ownership(layers=(i, i + 1))) for i in range(layers)]
    assert stages[0].config.num_layers == layers
    prompt = repetitive_prompt(stages[0].config.vocab_size)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.8, top_p=0.9, seed=5)
    plain, plain_keys, _ = _run(stages, prompt, params, OFF)
    speculation = Speculation("ngram", draft_max=3, source=_scripted(plain, len(prompt)))
    drafted, keys, pipeline = _run(stages, prompt, params, speculation)
    assert drafted == plain
    stats = pipeline.workers[0].speculated()
    assert stats["follows"] > 0 and 0 < stats["accepted"] < stats["drafted"], stats
    assert any(r.flags & RowFlag.FOLLOW for r in pipeline.rows), (
        "no window went on from one in flight"
    )
    assert pipeline.workers[-1].stale_windows > 0, "no window was stale"
    for stage, (ours, theirs) in enumerate(zip(keys, plain_keys)):
        for layer in theirs:
            diff = (ours[layer] - theirs[layer]).abs().amax(dim=(0, 2))  # per position
            where = torch.nonzero(diff > ROUNDING).flatten().tolist()
            assert not where, (
                f"stage {stage} layer {layer}: positions {where} (prompt {len(prompt)}) {diff[where]}"
            )
