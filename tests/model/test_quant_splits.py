"""Quantized GGUF MoE models in every split: one process, a 2-stage mesh, a 2-rank lockstep group.

A random Mixtral and a random DeepSeek-V3 (MLA, shared expert, noaux_tc routing) are built
by transformers and written as GGUF in llama.cpp's Q4_K_M mix (Q4_K and Q6_K blocks written
by seamline's own quantiser) and as Q8_0 (gguf-py's). Each runs quantized (float32
activations) in one process; the 2-stage mesh must give the same greedy text (a stage
boundary changes no arithmetic); the lockstep group the same greedy tokens, with logits within
``ATOL`` at every step (partial sums over experts and heads change the summation order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from seamline.app import LocalModel, default_model_path
from seamline.model.linear import ColumnWindow
from seamline.params import SamplingParams
from seamline.quant.tensor import QuantTensor
from seamline.runtime.engine import Engine
from seamline.weights.gguf_write import write_gguf_from_folder
from seamline.weights.loader import load_stage, open_source
from tests.support.deepseek import randomize
from tests.support.lockstep_harness import (
    PROMPT,
    check_group,
    engine_reference,
    running_group,
)
from tests.support.mesh_harness import split_completion

ATOL = 1e-4  # float32 logits of random weights; measured 1.1e-6 to 1.3e-6 (printed by check_group)
CONTEXT = 256
VOCAB = 49152  # the embedded model's tokenizer, copied into each file so the mesh can serve text
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=CONTEXT,
    tie_word_embeddings=False,
)
BUILDERS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            **COMMON,
            intermediate_size=512,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            **COMMON,
            num_key_value_heads=4,
            intermediate_size=512,
            moe_intermediate_size=256,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=256,
            kv_lora_rank=256,
            qk_nope_head_dim=32,
            qk_rope_head_dim=32,
            v_head_dim=64,
            first_k_dense_replace=1,
        )
    ),
}  # 4 heads x 64: a rank's o_proj columns, 2 x 64, cut the 256-wide K-quant blocks


def build_gguf(family: str, mix: str, folder: Path) -> Path:
    model = BUILDERS[family]()
    randomize(model, seed=1)
    for p in model.parameters():  # smaller weights: 256-wide layers at the scale of 64-wide ones
        p.data.mul_(0.5 if p.dim() > 1 else 1.0)
    model.save_pretrained(folder / "hf")
    return write_gguf_from_folder(
        folder / "hf", folder / f"{family}-{mix}.gguf", mix, tokenizer_from=default_model_path()
    )


CASES = [
    ("mixtral", "Q4_K_M"),
    ("deepseek_v3", "Q4_K_M"),
    ("mixtral", "Q8_0"),
    ("deepseek_v3", "Q8_0"),
]
_built: dict[tuple[str, str], Path] = {}


def built(case: tuple[str, str], factory: pytest.TempPathFactory) -> Path:
    if case not in _built:
        _built[case] = build_gguf(*case, factory.mktemp("-".join(case)))
    return _built[case]


@pytest.fixture(params=CASES, ids=["-".join(c) for c in CASES])
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built(request.param, tmp_path_factory)


def _types(path: Path) -> set[str]:
    stage = load_stage(open_source(path))
    return {
        w.qtype.name
        for m in stage.modules()
        for w in vars(m).values()
        if isinstance(w, QuantTensor)
    }


def test_one_process_runs_on_the_blocks(quantized: Path) -> None:
    types = _types(quantized)  # Q4_K_M: with llama.cpp's fallbacks where rows are not 256-wide
    assert {"Q4_K", "Q6_K"} <= types if "Q4_K_M" in quantized.name else types == {"Q8_0"}, types


def test_lockstep_group_equals_one_process(quantized: Path) -> None:
    ref = engine_reference(Engine(load_stage(open_source(quantized))), PROMPT, steps=24)
    with running_group(quantized, 2) as group:
        if "Q4_K_M" in quantized.name:  # 2 of 4 heads: half a 256-wide block of o_proj's columns
            assert isinstance(group.leader.stage.layers["0"].attn.o, ColumnWindow)  # type: ignore[union-attr]
        check_group(group, ref, ATOL)


@pytest.mark.parametrize("case", CASES[:2], ids=["-".join(c) for c in CASES[:2]])
def test_two_stage_mesh_equals_one_process(
    case: tuple[str, str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The Q4_K_M files (their mix holds both K types); a stage boundary is type-blind."""
    quantized = built(case, tmp_path_factory)
    local = LocalModel.load(quantized, context=CONTEXT)
    prompt = "The rivers of Europe include"
    expected = local.codec.decode(
        list(local.engine.generate(local.codec.encode(prompt), SamplingParams(max_tokens=16)))
    )
    assert split_completion(tmp_path / "mesh", quantized, prompt, 16, CONTEXT) == expected
