"""DeepSeek-V2/V3 as llama.cpp's ``deepseek2`` GGUF: written, read back, compared with transformers.

Tiny random checkpoints (the configs of test_deepseek_models) are written as GGUF with
``kv_b_proj`` split into ``attn_k_b`` + ``attn_v_b`` (current llama.cpp) and joined (older
files). Tolerances: F32 files match transformers to 1e-4 on fp32 logits; Q8_0 and Q4_K_M files
match transformers run on the file's dequantised weights to 1e-4, with seamline's quantised
matmul dequantising (routing on 8 experts turns kernel rounding into different experts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from seamline.config import ModelConfig
from seamline.weights.gguf import GGUFSource
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_mla import join_kv_b, split_kv_b
from seamline.weights.gguf_write import write_gguf_from_folder
from seamline.weights.loader import load_stage
from seamline.weights.safetensors import HFFolderSource
from tests.support.deepseek import (
    CASES,
    YARN,
    assert_close_logits,
    build_deepseek,
    deepseek_tokens,
    run_stages,
    transformers_logits,
)
from tests.support.gguf_reference import dequantised_model

# llama.cpp's deepseek2 keeps one yarn mscale (mscale_all_dim): cases with mscale equal to it
EQUAL_YARN = {**YARN, "mscale": YARN["mscale_all_dim"]}
GGUF_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v3": CASES["v3"],
    "v3_yarn": ("v3", {**CASES["v3_yarn"][1], "rope_parameters": EQUAL_YARN}),
    "v2_lite_greedy": CASES["v2_lite_greedy"],
    "v2_group_limited_yarn": (
        "v2",
        {**CASES["v2_group_limited_yarn"][1], "rope_parameters": EQUAL_YARN},
    ),
}


@pytest.fixture(autouse=True)
def gguf_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, case in GGUF_CASES.items():
        monkeypatch.setitem(CASES, "gguf_" + name, case)


@pytest.mark.parametrize("kv_b", ["split", "joined"])
@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_f32_file_matches_transformers(tmp_path: Path, case: str, kv_b: str) -> None:
    model, folder = build_deepseek(tmp_path, "gguf_" + case)
    path = write_gguf_from_folder(folder, tmp_path / "m.gguf", "F32", kv_b=kv_b)
    names = set(GGUFFile.open(path).tensors)
    split = {"blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= names
    assert split == (kv_b == "split") != ("blk.0.attn_kv_b.weight" in names)
    ids = deepseek_tokens()
    assert_close_logits(
        run_stages([load_stage(GGUFSource(path))], ids), transformers_logits(model, ids)
    )


@pytest.mark.parametrize(
    "case,kv_b,types",
    [("v3", "split", "Q8_0"), ("v2_lite_greedy", "joined", "Q8_0"), ("v3_yarn", "split", "Q4_K_M")],
)
def test_quantised_file_matches_its_dequantised_weights(
    tmp_path: Path, case: str, kv_b: str, types: str, torch_matmul: None
) -> None:
    _, folder = build_deepseek(tmp_path, "gguf_" + case)
    path = write_gguf_from_folder(folder, tmp_path / "m.gguf", types, kv_b=kv_b)
    ids = deepseek_tokens()
    ref = transformers_logits(dequantised_model(path, folder, tmp_path / "deq"), ids)
    assert_close_logits(run_stages([load_stage(GGUFSource(path))], ids), ref)


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_config_round_trips(tmp_path: Path, case: str) -> None:
    _, folder = build_deepseek(tmp_path, "gguf_" + case)
    path = write_gguf_from_folder(folder, tmp_path / "m.gguf", "F32")
    got = ModelConfig.from_hf_dict(GGUFSource(path).config_dict())
    want = ModelConfig.from_hf_dict(HFFolderSource(folder).config_dict())
    fields = (
        "family",
        "num_layers",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "moe_layers",
        "n_shared_experts",
        "n_group",
        "topk_group",
        "topk_method",
        "scoring_func",
        "routed_scaling_factor",
        "rope_interleave",
        "rope_theta",
    )
    for field in fields:
        assert getattr(got, field) == getattr(want, field), field
    g, w = got.rope_scaling, want.rope_scaling
    assert (g.rope_type, g.factor, g.original_max_position_embeddings) == (
        w.rope_type,
        w.factor,
        w.original_max_position_embeddings,
    )
    assert np.isclose(g.mscale_all_dim, w.mscale_all_dim) and np.isclose(g.mscale, w.mscale)


def test_k_b_v_b_join_inverts_the_split() -> None:
    heads, nope, v, lora = 3, 4, 5, 6
    kv_b = np.random.default_rng(0).standard_normal((heads * (nope + v), lora)).astype(np.float32)
    k_b, v_b = split_kv_b(kv_b, heads, nope)
    assert k_b.shape == (heads, lora, nope) and v_b.shape == (heads, v, lora)
    assert np.array_equal(k_b[1], kv_b[(nope + v) : (nope + v) + nope].T)  # head 1's key rows
    assert np.array_equal(join_kv_b(k_b, v_b), kv_b)


def test_unequal_yarn_mscales_are_refused(tmp_path: Path) -> None:
    _, folder = build_deepseek(tmp_path, "v3_yarn")  # mscale 0.9, mscale_all_dim 0.7
    with pytest.raises(ValueError, match="mscale"):
        write_gguf_from_folder(folder, tmp_path / "m.gguf", "F32")
