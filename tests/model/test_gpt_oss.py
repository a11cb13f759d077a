"""gpt-oss (``gpt_oss``) against transformers' ``GptOssForCausalLM``.

Random checkpoints written by transformers (float weights; its experts stacked as transformers
writes them), with non-zero biases and sinks: attention with a learned sink logit per head and
biases on q/k/v and the output, sliding (window 8, shorter than the prompt) and full layers
alternating, YaRN RoPE without truncation, a router with a bias whose top-k logits are
softmaxed, experts with biases and the clamped SwiGLU. Float32 logits within 1e-4 at once, in
chunks and decoding; 32 greedy tokens equal transformers'; a 2-stage split and a 2-rank lockstep
group equal one process; batched sequences equal each alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from seamline.quant.scaled import ScaledTensor
from seamline.runtime.engine import Engine
from seamline.weights.loader import load_stage, open_source
from tests.support.family_checks import (
    assert_batched_equal_alone,
    assert_greedy_matches,
    assert_group_matches,
    assert_logits_match,
    assert_split_matches,
)
from tests.support.lockstep_harness import PROMPT, engine_reference, run_group
from tests.support.mxfp4 import write_mxfp4_experts
from tests.support.oss import OSS, save_oss
from tests.support.reference import random_ids, reference_logits, seamline_logits

ATOL = 1e-4


@pytest.fixture(scope="module")
def oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("oss")
    return save_oss(folder), folder


def test_the_config_reads_as_transformers_builds_it(oss: tuple[Any, Path]) -> None:
    _, folder = oss
    config = load_stage(open_source(folder)).config
    assert (config.sliding_window, set(config.sliding_layers)) == (8, {0, 2})
    assert (config.rope_scaling.rope_type, config.rope_scaling.truncate) == ("yarn", False)
    assert (
        config.attention_sinks
        and config.attention_out_bias
        and config.scoring_func == "topk_softmax"
    )
    assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)


def test_logits_match_transformers_at_once_in_chunks_and_decoding(oss: tuple[Any, Path]) -> None:
    assert_logits_match(*oss, chunk=6)


def test_greedy_tokens_match_transformers(oss: tuple[Any, Path]) -> None:
    assert_greedy_matches(*oss)


def test_a_stage_split_equals_transformers(oss: tuple[Any, Path]) -> None:
    assert_split_matches(*oss, cuts=(1,))


def test_a_lockstep_group_equals_one_process(tmp_path: Path) -> None:
    """Experts, heads (their sinks with them), the head's vocabulary over 2 ranks; the output
    bias added once."""
    save_oss(tmp_path)
    assert_group_matches(tmp_path)


def test_batched_sequences_equal_each_alone(oss: tuple[Any, Path]) -> None:
    assert_batched_equal_alone(oss[1])


def test_mxfp4_experts_stay_at_their_size_and_match_transformers(tmp_path: Path) -> None:
    """The published layout: each expert matrix as MXFP4 blocks and scales. Read as fp4 weights
    of the file's bytes (not float), the logits equal transformers' over the float weights those
    blocks hold; a 2-rank group (each rank its experts) equals one process."""
    model = save_oss(tmp_path)
    write_mxfp4_experts(model, tmp_path)
    stage = load_stage(open_source(tmp_path))
    experts = stage.layers["0"].ffn.experts_gate_up
    assert isinstance(experts, ScaledTensor) and experts.kind == "fp4"
    e, rows, cols = OSS["num_local_experts"], 2 * OSS["intermediate_size"], OSS["hidden_size"]
    assert experts.values.numel() == e * rows * cols // 2 and experts.values.dtype == torch.uint8
    ids = random_ids(256)
    assert (seamline_logits(stage, ids) - reference_logits(model, ids)).abs().max().item() < ATOL
    run_group(tmp_path, 2, engine_reference(Engine(stage), PROMPT))
