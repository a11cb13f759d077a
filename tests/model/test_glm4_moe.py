"""GLM-4.5-style MoE (``glm4_moe``) against transformers' ``Glm4MoeForCausalLM``.

Random checkpoints written by transformers: grouped-query attention with q/k/v biases, RoPE on
the leading half of each head (``partial_rotary_factor`` 0.5), q/k norms where the config asks,
a dense first layer, then DeepSeek-V3's routing (sigmoid scores, a correction bias, groups
ranked by their top-2 biased scores, the chosen scores normalised and scaled) over routed
experts plus a shared one. Float32 logits within 1e-4 at once, in chunks and decoding; 32
greedy tokens equal transformers'; a 2-stage split and a 2-rank lockstep group equal one
process; sequences batched together equal each alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from seamline.weights.loader import load_stage, open_source
from tests.support.family_checks import (
    assert_batched_equal_alone,
    assert_greedy_matches,
    assert_group_matches,
    assert_logits_match,
    assert_split_matches,
)
from tests.support.glm import save_glm

ATOL = 1e-4


@pytest.fixture(scope="module", params=[True, False], ids=["qk-norm", "no-qk-norm"])
def glm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("glm")
    return save_glm(folder, request.param), folder


def test_the_config_reads_as_transformers_builds_it(glm: tuple[Any, Path]) -> None:
    model, folder = glm
    config = load_stage(open_source(folder)).config
    assert (config.rotary_dim, config.attention_bias, config.qk_norm) == (
        8,
        True,
        model.config.use_qk_norm,
    )
    assert (config.topk_method, config.scoring_func, config.n_group, config.topk_group) == (
        "noaux_tc",
        "sigmoid",
        2,
        1,
    )
    assert (
        config.moe_layers == (1, 2)
        and config.n_shared_experts == 1
        and config.routed_scaling_factor == 2.5
    )


def test_logits_match_transformers_at_once_in_chunks_and_decoding(glm: tuple[Any, Path]) -> None:
    assert_logits_match(*glm, chunk=7)


def test_greedy_tokens_match_transformers(glm: tuple[Any, Path]) -> None:
    assert_greedy_matches(*glm)


def test_a_stage_split_equals_transformers(glm: tuple[Any, Path]) -> None:
    assert_split_matches(*glm, cuts=(1, 2))  # after the dense layer; between the MoE layers


def test_a_lockstep_group_equals_one_process(tmp_path: Path) -> None:
    """Experts, heads and the head's vocabulary rows split over 2 ranks."""
    save_glm(tmp_path)
    assert_group_matches(tmp_path)


def test_batched_sequences_equal_each_alone(glm: tuple[Any, Path]) -> None:
    assert_batched_equal_alone(glm[1])
