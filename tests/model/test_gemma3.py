"""Gemma 3's text model (``gemma3_text``) against transformers' ``Gemma3ForCausalLM``.

Random checkpoints written by transformers: the embedding times sqrt(hidden), four norms a layer
that multiply by 1 + weight (read as folded, so the weights here are 1 + w), q/k norms, a
GELU-tanh gate, queries scaled by query_pre_attn_scalar (24, not head_dim), five sliding layers
(window 8, shorter than the prompt) on their own RoPE base, then a full one on the model's base
with linear scaling. Float32 logits within 1e-4 at once, in chunks and decoding; 32 greedy tokens
equal transformers'; a 2-stage split and a 2-rank lockstep group equal one process; batched
sequences and a prefix fork longer than the window equal each alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the reference: a test dependency, never skipped

from seamline.params import SamplingParams
from seamline.runtime.core import EngineCore
from seamline.runtime.engine import Engine
from seamline.weights.loader import load_stage, open_source
from tests.support.family_checks import (
    assert_greedy_matches,
    assert_group_matches,
    assert_logits_match,
    assert_split_matches,
)
from tests.support.reference import random_ids, reference_logits, save_random_model, seamline_logits

ATOL = 1e-4
GEMMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=24,
    max_position_embeddings=256,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)


def save_gemma(folder: Path) -> Any:
    return save_random_model(transformers.Gemma3TextConfig(**GEMMA), folder)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("gemma3")
    return save_gemma(folder), folder


def test_the_config_reads_as_transformers_builds_it(gemma: tuple[Any, Path]) -> None:
    model, folder = gemma
    stage = load_stage(open_source(folder))
    config = stage.config
    assert (config.sliding_window, set(config.sliding_layers)) == (8, {0, 1, 2, 3, 4})
    assert (config.rope_theta, config.rope_scaling.rope_type, config.local_rope_theta) == (
        1e6,
        "linear",
        1e4,
    )
    assert (
        config.embed_scale == 8.0
        and config.attention_scale == 24**-0.5
        and config.tie_word_embeddings
    )
    theirs = model.model.layers[0].post_feedforward_layernorm.weight
    assert torch.equal(
        stage.layers["0"].ffn_out_norm.weight, 1.0 + theirs
    )  # the 1 + w the norm multiplies by


def test_logits_match_transformers_at_once_in_chunks_and_decoding(gemma: tuple[Any, Path]) -> None:
    assert_logits_match(*gemma, chunk=5)


def test_greedy_tokens_match_transformers(gemma: tuple[Any, Path]) -> None:
    assert_greedy_matches(*gemma)


def test_a_stage_split_equals_transformers(gemma: tuple[Any, Path]) -> None:
    assert_split_matches(*gemma, cuts=(3,))


def test_a_lockstep_group_equals_one_process(tmp_path: Path) -> None:
    """Heads, feed-forward rows and the head's vocabulary over 2 ranks; the norms after the
    attention and the feed-forward apply to the gates' sums."""
    save_gemma(tmp_path)
    assert_group_matches(tmp_path)


def test_batched_sequences_and_a_forked_prefix_equal_each_alone(gemma: tuple[Any, Path]) -> None:
    _, folder = gemma
    stage = load_stage(open_source(folder))
    base = random_ids(256, 20, seed=4).tolist()
    params = SamplingParams(max_tokens=16)
    core = EngineCore.local(stage, context_length=128, prefix_cache_bytes=1 << 24)
    batched = [core.scheduler.add(p, params) for p in (base, random_ids(256, 11, seed=5).tolist())]
    while not core.scheduler.idle:
        core.step()
    forked = core.scheduler.add(base + [3, 4, 5], params)
    while not core.scheduler.idle:
        core.step()
    engine = Engine(stage, 128)
    for sequence in (*batched, forked):
        assert sequence.tokens == list(engine.generate(sequence.prompt, params))


def test_a_multimodal_gemma3_folder_serves_its_text_model(tmp_path: Path) -> None:
    """``gemma3`` (4B and up): the text model under ``text_config`` and ``language_model.*``,
    beside a vision tower left out; logits as transformers' ``Gemma3ForConditionalGeneration``
    gives them for text."""
    text = transformers.Gemma3TextConfig(**GEMMA)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=255,
        boi_token_index=254,
        eoi_token_index=253,
    )
    model = save_random_model(config, tmp_path)
    stage = load_stage(open_source(tmp_path))
    assert (
        stage.config.family == "gemma3_text"
        and stage.config.num_layers == GEMMA["num_hidden_layers"]
    )
    ids = random_ids(200)
    assert (seamline_logits(stage, ids) - reference_logits(model, ids)).abs().max().item() < ATOL
