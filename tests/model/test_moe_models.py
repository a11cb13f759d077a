"""MoE models against transformers (the reference), and the expert split against the unsplit.

Tiny random-weight checkpoints are built with transformers inside each test. Whole-model
tests (Mixtral, Qwen3-MoE) compare logits over a prefill and greedy decode steps; module
tests compare one MoE layer (DeepSeek-V2/V3 routing included) and check that two expert
shards sum to the full layer. Tolerances are fp32: 1e-4 on logits, 1e-5 on a layer.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers  # the reference: a test dependency, never skipped
from torch import nn

from seamline.config import ModelConfig
from seamline.errors import ConfigError
from seamline.model.moe import MoE, balance_rows, route
from seamline.ownership import Ownership
from seamline.weights.loader import load_stage
from seamline.weights.safetensors import HFFolderSource
from tests.support.configs import mixtral_config, qwen3_moe_config

PREFILL, DECODE = 32, 16
LOGIT_ATOL, LAYER_ATOL = 1e-4, 1e-5


def deepseek_config(version: int, **routing: Any) -> Any:
    cls = transformers.DeepseekV2Config if version == 2 else transformers.DeepseekV3Config
    return cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        **routing,
    )


def seamline_config(hf_config: Any) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_config.to_dict())


def save_checkpoint(hf_config: Any, cls: type, path: Path) -> nn.Module:
    torch.manual_seed(0)
    model = cls(hf_config).eval()
    model.save_pretrained(path)
    return model


@torch.inference_mode()
def compare_logits(model: nn.Module, path: Path) -> None:
    """Prefill PREFILL random tokens, then DECODE greedy steps; logits must agree."""
    stage = load_stage(HFFolderSource(path), None, torch.float32)
    ids = torch.randint(0, 256, (PREFILL,), generator=torch.Generator().manual_seed(1))
    cache = stage.new_cache()
    ours = stage(ids, 0, cache)  # [T, vocab]
    ref = model(ids[None], use_cache=True)
    torch.testing.assert_close(ours, ref.logits[0], atol=LOGIT_ATOL, rtol=0)
    past, pos = ref.past_key_values, PREFILL
    for _ in range(DECODE):
        token = int(ref.logits[0, -1].argmax())
        ours = stage(torch.tensor([token]), pos, cache)
        ref = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        torch.testing.assert_close(ours, ref.logits[0], atol=LOGIT_ATOL, rtol=0)
        past, pos = ref.past_key_values, pos + 1


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_mixtral_matches_transformers(tmp_path: Path) -> None:
    model = save_checkpoint(mixtral_config(), transformers.MixtralForCausalLM, tmp_path)
    compare_logits(model, tmp_path)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_matches_transformers(tmp_path: Path, norm_topk_prob: bool) -> None:
    hf_config = qwen3_moe_config(norm_topk_prob)
    assert seamline_config(hf_config).moe_layers == (0, 2)  # layer 1 is dense
    model = save_checkpoint(hf_config, transformers.Qwen3MoeForCausalLM, tmp_path)
    compare_logits(model, tmp_path)


# ---- module level: one MoE layer, full and split by experts ----

HALVES = (((0, 4), (0, 2)), ((4, 8), (1, 2)))  # (experts, shard) for E = 8


def put(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set a parameter (the module's are shape-only placeholders until filled)."""
    setattr(module, name, nn.Parameter(value, requires_grad=False))


def fill_from_hf(moe: MoE, hf: nn.Module, own: Ownership, config: ModelConfig) -> None:
    """Copy transformers' layer weights into ``moe``, sliced to what ``own`` owns."""
    e0, e1 = own.expert_range(config)
    put(moe, "router", hf.gate.weight.detach().float().clone())
    if moe.router_bias is not None:
        put(moe, "router_bias", hf.gate.e_score_correction_bias.detach().clone())
    put(moe, "experts_gate_up", hf.experts.gate_up_proj.detach()[e0:e1].clone())
    put(moe, "experts_down", hf.experts.down_proj.detach()[e0:e1].clone())
    if moe.shared is not None:  # whole on every rank; each computes its rows of it
        mlp = hf.shared_experts
        put(
            moe.shared,
            "gate_up",
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().clone(),
        )
        put(moe.shared, "down", mlp.down_proj.weight.detach().clone())


def hf_layer(hf_config: Any, layer: int) -> nn.Module:
    """One randomly initialised transformers MoE layer (router biased for DeepSeek-V3)."""
    torch.manual_seed(0)
    family = type(hf_config).__name__.removesuffix("Config")
    model_cls = getattr(transformers, family + "ForCausalLM")
    hf_config.initializer_range = 0.1  # clear routing margins
    block = model_cls(hf_config).model.layers[layer].mlp.eval()
    if hasattr(block.gate, "e_score_correction_bias"):
        block.gate.e_score_correction_bias.copy_(0.3 * torch.randn(hf_config.n_routed_experts))
    return block


def build_moe(hf_config: Any, hf: nn.Module, own: Ownership | None = None) -> MoE:
    config = seamline_config(hf_config)
    own = own or Ownership.full(config)
    moe = MoE(config, own)
    fill_from_hf(moe, hf, own, config)
    return moe


ROUTING_CASES = {
    "mixtral": lambda: mixtral_config(),
    "qwen3_moe_norm": lambda: qwen3_moe_config(True),
    "qwen3_moe_raw": lambda: qwen3_moe_config(False),
    "deepseek_v2_greedy": lambda: deepseek_config(2, routed_scaling_factor=16.0),
    "deepseek_v2_group": lambda: deepseek_config(
        2, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0
    ),
    "deepseek_v3": lambda: deepseek_config(3, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "deepseek_v3_raw": lambda: deepseek_config(3, n_group=2, topk_group=1, norm_topk_prob=False),
}


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
@pytest.mark.parametrize("tokens", [1, 24])
@torch.inference_mode()
def test_moe_layer_matches_transformers(case: str, tokens: int) -> None:
    hf_config = ROUTING_CASES[case]()
    layer = seamline_config(hf_config).moe_layers[-1]
    hf = hf_layer(hf_config, layer)
    moe = build_moe(hf_config, hf)
    x = torch.randn(tokens, hf_config.hidden_size, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(moe(x), hf(x[None])[0], atol=LAYER_ATOL, rtol=0)


def test_balance_rows_evens_out_the_busiest_rank() -> None:
    assert balance_rows([5 * 768, 3 * 768], 768) == [(0, 0), (0, 768)]  # the idler rank takes all
    assert balance_rows([4 * 768, 4 * 768], 768) == [(0, 384), (384, 768)]
    assert balance_rows([0, 0, 0], 4) == [(0, 1), (1, 2), (2, 4)]  # the leader gives back first
    rng = random.Random(0)
    for _ in range(500):
        loads = [rng.randrange(0, 50) for _ in range(rng.randrange(1, 6))]
        rows = rng.randrange(0, 60)
        ranges = balance_rows(loads, rows)
        assert [r[0] for r in ranges] == [0] + [r[1] for r in ranges[:-1]] and ranges[-1][1] == rows
        assert all(end >= start for start, end in ranges)
        busiest = max(load + end - start for load, (start, end) in zip(loads, ranges))
        assert busiest == max(max(loads), -(-(sum(loads) + rows) // len(loads)))  # the optimum


@torch.inference_mode()
def test_a_decode_step_splits_the_shared_expert_by_its_routing() -> None:
    """Each half computes the shared rows that balance_rows gives it for that token's experts."""
    hf_config = ROUTING_CASES["deepseek_v3"]()
    config = seamline_config(hf_config)
    hf = hf_layer(hf_config, config.moe_layers[-1])
    halves = [
        build_moe(hf_config, hf, Ownership((0, config.num_layers), experts=e, shard=s))
        for e, s in HALVES
    ]
    rows, inter, seen = (
        config.n_shared_experts * config.moe_intermediate_size,
        config.moe_intermediate_size,
        set(),
    )
    for seed in range(40):
        x = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(seed))
        _, ids = route(config, F.linear(x, halves[0].router), halves[0].router_bias)
        chosen = ids[0].tolist()
        counts = [sum(1 for e in chosen if e < 4), sum(1 for e in chosen if e >= 4)]
        expected = balance_rows([c * inter for c in counts], rows)
        assert [h._shared_rows(chosen) for h in halves] == expected
        seen.add(tuple(counts))
        torch.testing.assert_close(
            halves[0](x) + halves[1](x), hf(x[None])[0], atol=LAYER_ATOL, rtol=0
        )
    assert len(seen) > 1, seen  # both balanced and unbalanced tokens were met


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
@pytest.mark.parametrize("tokens", [1, 24])
@torch.inference_mode()
def test_expert_shards_sum_to_full_layer(case: str, tokens: int) -> None:
    hf_config = ROUTING_CASES[case]()
    config = seamline_config(hf_config)
    layers = (0, config.num_layers)
    hf = hf_layer(hf_config, config.moe_layers[-1])
    full = build_moe(hf_config, hf)
    halves = [build_moe(hf_config, hf, Ownership(layers, experts=e, shard=s)) for e, s in HALVES]
    inter = config.moe_intermediate_size
    for half in halves:
        assert half.experts_gate_up.shape == (4, 2 * inter, config.hidden_size)
        assert half.experts_down.shape == (4, config.hidden_size, inter)
        assert half.router.shape == (8, config.hidden_size)
        if half.shared is not None:
            assert half.shared.down.shape == (config.hidden_size, config.n_shared_experts * inter)
    x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(3))
    total = halves[0](x) + halves[1](x)
    torch.testing.assert_close(total, full(x), atol=LAYER_ATOL, rtol=0)


@pytest.mark.parametrize("cfg_fn", [mixtral_config, lambda: qwen3_moe_config(False)])
@torch.inference_mode()
def test_loader_expert_shards_sum_to_full(tmp_path: Path, cfg_fn: Any) -> None:
    """Through the checkpoint tables: each shard reads only its experts; partials sum to full."""
    hf_config = cfg_fn()
    cls = getattr(transformers, type(hf_config).__name__.removesuffix("Config") + "ForCausalLM")
    save_checkpoint(hf_config, cls, tmp_path)
    config = seamline_config(hf_config)
    source = HFFolderSource(tmp_path)
    layers = (0, config.num_layers)
    full = load_stage(source, Ownership.full(config), torch.float32)
    owns = [Ownership(layers, experts=e, shard=s) for e, s in HALVES]
    parts = [load_stage(source, own, torch.float32) for own in owns]
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(4))
    for i in config.moe_layers:
        a, b = (part.layers[str(i)].ffn for part in parts)
        assert a.experts_down.shape[0] == b.experts_down.shape[0] == 4
        for rows in (x, x[:1]):  # prefill and decode paths
            expected = full.layers[str(i)].ffn(rows)
            torch.testing.assert_close(a(rows) + b(rows), expected, atol=LAYER_ATOL, rtol=0)


def test_empty_expert_shard_returns_zero() -> None:
    config = seamline_config(mixtral_config())
    moe = MoE(config, Ownership((0, 2), experts=(3, 3)))
    assert moe.experts_gate_up.shape[0] == 0
    put(moe, "router", torch.randn(8, 64))
    for tokens in (1, 6):
        assert torch.count_nonzero(moe(torch.randn(tokens, 64))) == 0


@pytest.mark.parametrize(
    "routing, message",
    [
        (dict(topk_method="bogus"), "topk_method"),
        (dict(scoring_func="relu"), "scoring_func"),
        (dict(topk_method="group_limited_greedy", n_group=3, topk_group=1), "n_group"),
        (dict(topk_method="noaux_tc", n_group=2, topk_group=3), "topk_group"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    ],
)
def test_bad_routing_config_names_the_invariant(routing: dict[str, Any], message: str) -> None:
    base = seamline_config(deepseek_config(2))
    config = ModelConfig(**{**base.__dict__, **routing})
    with pytest.raises(ConfigError, match=message):
        MoE(config, Ownership.full(config))
