"""A sliding layer's cache is a ring of its window (``model/cache.py``): it holds the window and
``RING_SLACK`` positions whatever the context, and still gives transformers' logits when a
sequence wraps it many times (at once, in chunks longer and shorter than the ring, decoding).
The KV budget, the planner and the prefix cache count it by its window: a long sequence on a
sliding model is charged the ring, not the context; a fork from a donor whose ring moved past
the shared prefix is a fresh prefill; a step further back than the ring holds is refused.

Random Qwen2 checkpoints (layers 2 and 3 of 4 sliding, window 8: a ring of 40) written by
transformers; float32, within 1e-4 of transformers' logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from seamline.config import RING_SLACK
from seamline.mesh.plan.types import ModelSpec
from seamline.model.cache import CacheOverrun, LayerKV
from seamline.params import SamplingParams
from seamline.runtime.core import EngineCore
from seamline.runtime.engine import Engine
from seamline.weights.loader import load_stage, open_source
from tests.support.reference import random_ids, reference_logits, save_random_model

ATOL = 1e-4
WINDOW = 8
RING = WINDOW + RING_SLACK
LONG = 5 * RING + 3  # wraps the ring five times


def _config(window: int = WINDOW) -> Any:
    """Qwen2 with its last two layers sliding (``window`` 0: none)."""
    return transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        use_sliding_window=bool(window),
        sliding_window=window or None,
        max_window_layers=2,
    )


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("qwen2-window")
    return save_random_model(_config(), folder), folder


@pytest.mark.parametrize("chunk", [LONG, 2 * RING + 5, 24, 7])
def test_a_sequence_wrapping_the_ring_gives_transformers_logits(
    qwen2: tuple[Any, Path], chunk: int
) -> None:
    """In chunks (one longer than the ring: it keeps its last positions), then decoding past them."""
    model, folder = qwen2
    ids = random_ids(256, LONG + 20, seed=3)
    want = reference_logits(model, ids)
    stage = load_stage(open_source(folder))
    cache = stage.new_cache()
    rows = [stage(ids[i : min(i + chunk, LONG)], i, cache) for i in range(0, LONG, chunk)]
    rows += [stage(ids[p : p + 1], p, cache) for p in range(LONG, ids.shape[0])]
    assert (torch.cat(rows) - want).abs().max().item() < ATOL
    held = {i: kv.k.shape[1] for i, kv in cache.layers.items() if kv.k is not None}
    assert (
        held[2] == held[3] == RING and held[0] >= LONG + 20
    )  # the sliding layers kept their ring only


def test_a_long_sequence_is_charged_its_window_not_the_context(
    qwen2: tuple[Any, Path], tmp_path: Path
) -> None:
    """The stage's bytes for 8k tokens, the scheduler's charge for a sequence that may reach them,
    and the planner's bytes per token: two full layers and two rings, against a model without a
    window (four full layers). Fails if a sliding layer is charged the full context."""
    _, folder = qwen2
    stage = load_stage(open_source(folder))
    save_random_model(_config(window=0), tmp_path)
    full = load_stage(open_source(tmp_path))  # the same shapes without a window
    assert full.config.sliding_window == 0
    per_layer = full.cache_bytes(8192) // 4
    assert stage.cache_bytes(8192) == 2 * per_layer + 2 * per_layer * RING // 8192
    core = EngineCore.local(stage, context_length=8192)
    sequence = core.scheduler.add([1, 2, 3], SamplingParams(max_tokens=8000))
    assert core.scheduler.kv_reserve(sequence) == stage.cache_bytes(8003)
    assert core.scheduler.kv_reserve(sequence) < 0.55 * full.cache_bytes(8003)
    spec = ModelSpec.from_config(stage.config, "w", (1,) * 4, 0, 0, 4, context=8192)
    whole = ModelSpec.from_config(full.config, "f", (1,) * 4, 0, 0, 4, context=8192)
    assert spec.layer_kv()[:2] == whole.layer_kv()[:2]
    assert spec.layer_kv()[2] == -(-whole.layer_kv()[2] * RING // 8192)  # the ring's share of 8k


def test_a_fork_is_taken_only_where_the_donor_still_holds_its_window(
    qwen2: tuple[Any, Path],
) -> None:
    """A finished sequence of LONG positions in the prefix cache: a prompt sharing all but its last
    positions forks it; one sharing only its first 20 (long wrapped out of the ring) is prefilled
    afresh. Both give the tokens and logits of the prompt alone."""
    _, folder = qwen2
    stage = load_stage(open_source(folder))
    base = random_ids(256, LONG, seed=4).tolist()
    params = SamplingParams(max_tokens=6)
    core = EngineCore.local(stage, context_length=1024, prefix_cache_bytes=1 << 26)
    core.scheduler.add(base, params)
    _drain(core)
    engine = Engine(stage, 1024)
    for prompt, forks in ((base[:-4] + [7, 8], True), (base[:20] + [9, 10, 11], False)):
        rows, sequence = _first_step_rows(core, stage, prompt, params)
        assert (rows < len(prompt)) == forks, (rows, len(prompt))
        assert sequence.tokens == list(engine.generate(prompt, params))


def _first_step_rows(
    core: EngineCore, stage: Any, prompt: list[int], params: SamplingParams
) -> tuple[int, Any]:
    """The rows of ``prompt``'s first step (fewer than its length: a fork gave the rest), and its sequence run to the end."""
    rows: list[int] = []
    forward = stage.forward_batch
    stage.forward_batch = lambda inputs, spans, **kw: (
        rows.append(len(inputs)) or forward(inputs, spans, **kw)
    )
    try:
        sequence = core.scheduler.add(prompt, params)
        _drain(core)
    finally:
        del stage.forward_batch
    return rows[0], sequence


def _drain(core: EngineCore) -> None:
    while not core.scheduler.idle:
        core.step()


def test_a_rewind_within_the_slack_recomputes_and_one_past_it_is_refused(
    qwen2: tuple[Any, Path],
) -> None:
    """A rejected speculative window goes back at most ``RING_SLACK`` positions: the rows written
    again equal the first ones; a step needing keys the ring dropped raises, naming both positions."""
    _, folder = qwen2
    stage = load_stage(open_source(folder))
    ids = random_ids(256, 3 * RING, seed=5)
    cache = stage.new_cache()
    first = stage(ids, 0, cache)
    back = ids.shape[0] - RING_SLACK
    again = torch.cat([stage(ids[p : p + 1], p, cache) for p in range(back, ids.shape[0])])
    assert (again - first[back:]).abs().max().item() < ATOL
    with pytest.raises(CacheOverrun, match="needs keys from"):
        stage(ids[:1], back - 2, cache)
    ring = LayerKV(ring=RING)
    ring.window_update(torch.zeros(1, 3 * RING, 2), torch.zeros(1, 3 * RING, 2), 0, WINDOW)
    with pytest.raises(CacheOverrun, match=f"holds them from {2 * RING}"):
        ring.window_update(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), 2 * RING, WINDOW)
