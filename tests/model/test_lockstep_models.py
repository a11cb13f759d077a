"""Lockstep groups of other families and of real weights, in real processes, against Engine.

Random Qwen3-MoE and DeepSeek-V3 checkpoints (MLA, shared experts, a dense first layer,
group-limited routing) on 2 and 4 ranks; the embedded SmolLM2 (9 query heads: 4 + 5 on two
ranks, 3 + 3 + 3 on three); and that model upcycled to a 4-expert Mixtral (tests/upcycle.py),
whose split must still answer like the dense model. Each group must give the single-process
Engine's greedy tokens and stay within a stated tolerance of its logits at every step.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers  # the reference builder: a test dependency, never skipped

from seamline.app import default_model_path
from seamline.config import ModelConfig
from seamline.params import SamplingParams
from seamline.runtime.engine import Engine
from seamline.text import TextCodec
from seamline.weights.loader import load_stage, open_source
from tests.support.configs import qwen3_moe_config
from tests.support.deepseek import build_deepseek, randomize
from tests.support.lockstep_harness import (
    PROMPT,
    Reference,
    check_group,
    engine_reference,
    generate_recording,
    run_group,
    running_group,
)
from tests.support.upcycle import upcycle

# The embedded model's real weights give logits of magnitude ~38 through 30 layers, and
# splitting heads (and experts) changes the fp32 summation order. Measured max
# |lockstep - engine| over the 65 forwards (prefill + 64 decodes) of the chat prompt: 2 ranks
# (4 + 5 heads) 4.8e-5, 3 ranks 5.2e-5, 4 ranks (2+2+2+3) 4.9e-5; the upcycled MoE on 2 ranks against the dense engine
# 4.2e-5 over 33 forwards — the same on every run here, greedy tokens identical. Logits reach
# ~38 in magnitude, so 1e-4 would be within 3x of fp32 rounding across 30 layers; 1e-3 keeps
# a 20x margin for kernels that vary with thread count and buffer alignment.
ATOL_EMBEDDED = 1e-3
QUESTION = "What is the capital of France?"
ANSWER_TOKENS = 32


def _qwen3_moe(folder: Path) -> Path:
    # 8 experts, top-3 renormalised; layer 1 dense. Weights as large as the DeepSeek ones.
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(norm_topk_prob=True))
    randomize(model, seed=0)
    model.save_pretrained(folder)
    return folder


def _deepseek_v3(folder: Path) -> Path:
    # 8 experts in 4 groups, top-2 groups (noaux_tc, biased); MLA with a q LoRA; one shared
    # expert; layer 0 dense (first_k_dense_replace=1)
    _, built = build_deepseek(folder, "v3")
    config = ModelConfig.from_hf_dict(open_source(built).config_dict())
    assert config.is_mla and config.n_shared_experts == 1 and config.moe_layers == (1, 2)
    assert (config.topk_method, config.n_group, config.topk_group) == ("noaux_tc", 4, 2)
    return built


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("build", [_qwen3_moe, _deepseek_v3], ids=["qwen3_moe", "deepseek_v3"])
def test_random_moe(tmp_path: Path, build: Callable[[Path], Path], world: int) -> None:
    model = build(tmp_path / "m")
    ref = engine_reference(Engine(load_stage(open_source(model))), PROMPT)
    run_group(model, world, ref)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_model(default_model_path())


@pytest.fixture(scope="module")
def embedded(codec: TextCodec) -> Reference:
    """The single-process Engine on the embedded model: 64 greedy steps of the chat prompt."""
    engine = Engine(load_stage(open_source(default_model_path())))
    return engine_reference(engine, codec.encode_chat([{"role": "user", "content": QUESTION}]))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_embedded_model(embedded: Reference, world: int) -> None:
    # 9 query heads / 3 KV heads: on 2 ranks 4 + 5 heads (KV head 1 held by both), on 3 even,
    # on 4 ranks 2 + 2 + 2 + 3 (KV heads 0 and 1 each held by two ranks)
    with running_group(default_model_path(), world) as group:
        assert group.leader.stage.layers["0"].attn.heads == 9 // world  # type: ignore[union-attr]
        check_group(group, embedded, ATOL_EMBEDDED)


def test_upcycled_moe_answers_like_the_dense_model(
    tmp_path: Path, embedded: Reference, codec: TextCodec
) -> None:
    folder = upcycle(default_model_path(), tmp_path / "upcycled", experts=4, top_k=2)
    try:
        _check_upcycled_config(folder)
        _check_upcycled_group(folder, embedded, codec)
    finally:
        shutil.rmtree(folder)  # 1.4 GB of fp32 experts


def _check_upcycled_config(folder: Path) -> None:
    """The Mixtral config reproduces the dense one: rope, norm eps, ties, heads, sizes."""
    dense = ModelConfig.from_hf_dict(open_source(default_model_path()).config_dict())
    moe = ModelConfig.from_hf_dict(open_source(folder).config_dict())
    differ = {k for k in dense.__dataclass_fields__ if getattr(dense, k) != getattr(moe, k)}
    moe_fields = {
        "family",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "moe_layers",
    }
    assert differ == moe_fields, differ - moe_fields
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (4, 2, True)
    assert moe.moe_layers == tuple(range(dense.num_layers))
    assert moe.moe_intermediate_size == dense.intermediate_size
    hf = transformers.AutoConfig.from_pretrained(folder)  # a config transformers reads as Mixtral
    assert type(hf).__name__ == "MixtralConfig" and hf.sliding_window is None


def _check_upcycled_group(folder: Path, dense: Reference, codec: TextCodec) -> None:
    """2 ranks, 2 of the 4 experts each: the dense engine's tokens (run past the answer's
    end, for more steps through the experts), and Paris in the answer."""
    with running_group(folder, 2) as group:
        _check_expert_share(group.leader.stage, folder)
        group.greedy_exchange = False  # whole logits, to compare them with the dense engine's
        tokens, logits = generate_recording(
            group, dense.prompt, SamplingParams(max_tokens=ANSWER_TOKENS)
        )
    assert tokens == dense.tokens[:ANSWER_TOKENS]
    answer = codec.decode(tokens[: next(i for i, t in enumerate(tokens) if t in codec.stop_ids)])
    assert "Paris" in answer, answer
    err = (logits - dense.logits[: len(logits)]).abs().max().item()
    print(
        f"max |upcycled lockstep - dense engine| = {err:.2e} over {len(logits)} forwards; {answer!r}"
    )
    assert err < ATOL_EMBEDDED


def _check_expert_share(stage: torch.nn.Module, folder: Path) -> None:
    """The leader loaded experts [0, 2) of every layer: half the checkpoint's expert weights."""
    source = open_source(folder)
    in_checkpoint = sum(
        torch.Size(source.shape(n)).numel() for n in source.names() if ".experts." in n
    )
    loaded = 0
    for name, param in stage.named_parameters():
        if ".experts_" in name:
            assert param.shape[0] == 2, (name, tuple(param.shape))
            loaded += param.numel()
    assert loaded * 2 == in_checkpoint, (loaded, in_checkpoint)
    total = sum(torch.Size(source.shape(n)).numel() for n in source.names())
    mine = sum(p.numel() for p in stage.parameters())
    print(
        f"leader holds {mine / 1e6:.0f}M of {total / 1e6:.0f}M parameters "
        f"({loaded / 1e6:.0f}M of {in_checkpoint / 1e6:.0f}M expert parameters)"
    )
    assert mine < 0.6 * total
