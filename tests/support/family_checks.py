"""The checks every newer family's random checkpoint passes against transformers: float32 logits
within 1e-4 at once, in chunks and decoding, split into two stages and read back from GGUF;
32 greedy tokens equal; a 2-rank lockstep group equal to one process; sequences batched
together equal each alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from seamline.params import SamplingParams
from seamline.runtime.core import EngineCore
from seamline.runtime.engine import Engine
from seamline.weights.loader import load_stage, open_source
from tests.support.lockstep_harness import PROMPT, engine_reference, run_group
from tests.support.reference import (
    PREFILL,
    random_ids,
    reference_logits,
    seamline_logits,
    split_logits,
)

ATOL = 1e-4


def assert_logits_match(model: Any, folder: Path, chunk: int) -> None:
    """At once, in chunks of ``chunk`` rows, and a prefill then one token at a time."""
    ids = random_ids(256)
    want = reference_logits(model, ids)
    stage = load_stage(open_source(folder))
    cache = stage.new_cache()
    chunks = torch.cat([stage(ids[i : i + chunk], i, cache) for i in range(0, ids.shape[0], chunk)])
    for got in (stage(ids, 0, stage.new_cache()), chunks, seamline_logits(stage, ids)):
        assert (got - want).abs().max().item() < ATOL


def assert_greedy_matches(model: Any, folder: Path) -> None:
    prompt = random_ids(256, PREFILL)
    with torch.no_grad():
        theirs = model.generate(
            prompt.unsqueeze(0), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )[0, PREFILL:]
    ours = list(
        Engine(load_stage(open_source(folder))).generate(
            prompt.tolist(), SamplingParams(max_tokens=32)
        )
    )
    assert ours == theirs.tolist()


def assert_group_matches(folder: Path) -> None:
    """A 2-rank lockstep group's 64 greedy tokens and logits equal one process's."""
    run_group(folder, 2, engine_reference(Engine(load_stage(open_source(folder))), PROMPT))


def assert_batched_equal_alone(folder: Path, lengths: tuple[int, ...] = (5, 19, 12)) -> None:
    stage = load_stage(open_source(folder))
    params = SamplingParams(max_tokens=16)
    core = EngineCore.local(stage, context_length=128)
    batched = [core.scheduler.add(random_ids(256, n, seed=n).tolist(), params) for n in lengths]
    while not core.scheduler.idle:
        core.step()
    engine = Engine(stage, 128)
    for sequence in batched:
        assert sequence.tokens == list(engine.generate(sequence.prompt, params))


def assert_split_matches(model: Any, folder: Path, cuts: tuple[int, ...]) -> None:
    """Two stages cut at each of ``cuts`` give transformers' logits."""
    ids = random_ids(256)
    want = reference_logits(model, ids)
    for cut in cuts:
        assert (split_logits(folder, cut, ids) - want).abs().max().item() < ATOL


def assert_gguf_matches(model: Any, path: Path) -> torch.Tensor:
    """A GGUF file's logits (prefill, then decoding) within 1e-4 of transformers'; they are returned."""
    ids = random_ids(256)
    want = reference_logits(model, ids)
    got = seamline_logits(load_stage(open_source(path)), ids)
    assert (got - want).abs().max().item() < ATOL
    return want


def assert_gguf_follows(want: torch.Tensor, path: Path) -> None:
    """A quantized GGUF file's logits follow the float model's ``want`` (correlation > 0.99)."""
    got = seamline_logits(load_stage(open_source(path)), random_ids(256))
    assert torch.corrcoef(torch.stack((got.flatten(), want.flatten())))[0, 1] > 0.99
