"""DeepSeek-V2/V3 (latent-KV attention, group-limited routing) against transformers.

Tiny random checkpoints are built by transformers, saved as Hugging Face folders, loaded by
seamline, and compared on the same tokens: a 32-token prefill, then 16 decode steps fed the
same (teacher-forced) tokens, against one full-sequence transformers forward. Tolerance:
atol 1e-4 on fp32 logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.model import mla  # noqa: E402
from seamline.ownership import Ownership  # noqa: E402
from seamline.weights.loader import load_stage  # noqa: E402
from seamline.weights.safetensors import HFFolderSource  # noqa: E402
from tests.support.deepseek import (
    CASES,
    assert_close_logits,
    build_deepseek,
    deepseek_tokens,
    run_stages,
    transformers_logits,
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path: Path, case: str) -> None:
    model, folder = build_deepseek(tmp_path, case)
    ids = deepseek_tokens()
    stage = load_stage(HFFolderSource(folder), None, torch.float32)
    assert_close_logits(run_stages([stage], ids), transformers_logits(model, ids))


@pytest.mark.parametrize("absorbed", [True, False])
def test_both_attention_paths_with_chunked_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, absorbed: bool
) -> None:
    """Latent-space (absorbed) and expanded attention, each with prefill chunks after a cache."""
    model, folder = build_deepseek(tmp_path, "v3_yarn")
    ids = deepseek_tokens()
    monkeypatch.setattr(mla.MLAttention, "_prefer_absorbed", lambda self, count: absorbed)
    stage = load_stage(HFFolderSource(folder), None, torch.float32)
    assert_close_logits(
        run_stages([stage], ids, chunks=(10, 1, 21)), transformers_logits(model, ids)
    )


@pytest.mark.parametrize("case,cut", [("v3", 1), ("v3", 2), ("v2_group_limited_yarn", 2)])
def test_stage_split_matches_full_model(tmp_path: Path, case: str, cut: int) -> None:
    model, folder = build_deepseek(tmp_path, case)
    ids = deepseek_tokens()
    source = HFFolderSource(folder)
    config = load_stage(source, Ownership(layers=(0, cut)), torch.float32).config
    first = load_stage(source, Ownership(layers=(0, cut)), torch.float32)
    second = load_stage(source, Ownership(layers=(cut, config.num_layers)), torch.float32)
    full = load_stage(source, Ownership.full(config), torch.float32)
    split_logits = run_stages([first, second], ids)
    assert torch.equal(split_logits, run_stages([full], ids)), "stage split changed the logits"
    assert_close_logits(split_logits, transformers_logits(model, ids))


def test_config_reads_mla_fields(tmp_path: Path) -> None:
    _, folder = build_deepseek(tmp_path, "v2_group_limited_yarn")
    config = load_stage(HFFolderSource(folder), None, torch.float32).config
    assert (config.family, config.q_lora_rank, config.kv_lora_rank) == ("deepseek_v2", 32, 32)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (16, 8, 16)
    assert (config.topk_method, config.n_group, config.topk_group) == ("group_limited_greedy", 2, 1)
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.mscale_all_dim == 0.7
    assert config.moe_layers == (1, 2)
