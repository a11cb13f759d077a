"""DeepSeek-V4's parts against transformers' own modules (random weights): hyper-connections, routing."""

from __future__ import annotations

import pytest
import torch

from seamline.model.hyper import HyperConnection, HyperHead, widen

HIDDEN, STREAMS, TOKENS = 32, 4, 5


@pytest.fixture(scope="module")
def config():  # type: ignore[no-untyped-def]
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=16,
        q_lora_rank=16,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=STREAMS,
        layer_types=["sliding_attention"] * 2,
        mlp_layer_types=["moe"] * 2,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=2,
    )


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return module


def _ours(module: torch.nn.Module, reference: torch.nn.Module) -> torch.nn.Module:
    for (
        name,
        param,
    ) in reference.named_parameters():  # the reference's head names its own with "hc_"
        ours = name.removeprefix("hc_")
        setattr(module, ours, torch.nn.Parameter(param.detach().clone(), requires_grad=False))
    return module


def test_the_mixes_equal_the_reference(config) -> None:  # type: ignore[no-untyped-def]
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HyperConnection,
    )

    reference = _randomised(DeepseekV4HyperConnection(config).float(), 1)
    ours = _ours(
        HyperConnection(
            HIDDEN, STREAMS, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        ),
        reference,
    )
    residual = torch.randn(TOKENS, STREAMS, HIDDEN, generator=torch.Generator().manual_seed(2))
    post, comb, collapsed = reference(residual.unsqueeze(0))
    got = ours.mixes(residual)
    for mine, theirs in zip(got, (collapsed[0], post[0], comb[0])):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert torch.allclose(
        got[2].sum(-1), torch.ones(TOKENS, STREAMS), atol=1e-3
    )  # near doubly stochastic
    assert torch.allclose(got[2].sum(-2), torch.ones(TOKENS, STREAMS), atol=1e-3)
    output = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    expected = post.unsqueeze(-1) * output.unsqueeze(0).unsqueeze(-2) + torch.matmul(
        comb.transpose(-1, -2), residual.unsqueeze(0)
    )
    torch.testing.assert_close(
        HyperConnection.spread(residual, output, got[1], got[2]), expected[0], rtol=0, atol=1e-5
    )


def test_the_head_collapse_equals_the_reference(config) -> None:  # type: ignore[no-untyped-def]
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    reference = _randomised(DeepseekV4HyperHead(config).float(), 4)
    ours = _ours(HyperHead(HIDDEN, STREAMS, config.hc_eps, config.rms_norm_eps), reference)
    residual = torch.randn(TOKENS, STREAMS, HIDDEN, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(
        ours(residual), reference(residual.unsqueeze(0))[0], rtol=0, atol=1e-6
    )


def test_the_first_residual_is_one_copy_of_the_embedding_per_stream() -> None:
    x = torch.randn(TOKENS, HIDDEN)
    widened = widen(x, STREAMS)
    assert widened.shape == (TOKENS, STREAMS, HIDDEN) and all(
        torch.equal(widened[:, k], x) for k in range(STREAMS)
    )


@pytest.mark.parametrize("hashed", [False, True], ids=["top-k", "hash"])
def test_v4_routing_equals_the_reference(config, hashed: bool) -> None:  # type: ignore[no-untyped-def]
    """sqrt(softplus) scores; top-k of the scores plus the correction bias (``noaux_tc`` over one
    group), or the experts a token's id selects in ``tid2eid``; weights normalised and scaled."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HashRouter,
        DeepseekV4TopKRouter,
    )

    from seamline.config import ModelConfig
    from seamline.model.moe import check_routing, route

    generator = torch.Generator().manual_seed(6)
    reference = (DeepseekV4HashRouter if hashed else DeepseekV4TopKRouter)(config)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(reference.weight.shape, generator=generator))
        if hashed:
            reference.tid2eid.copy_(
                torch.randint(
                    0, config.n_routed_experts, reference.tid2eid.shape, generator=generator
                )
            )
        else:
            reference.e_score_correction_bias.copy_(
                torch.randn(config.n_routed_experts, generator=generator)
            )
    ours = ModelConfig(
        family="deepseek_v4",
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=config.n_routed_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=16,
        scoring_func="sqrtsoftplus",
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=config.routed_scaling_factor,
    )
    check_routing(ours)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    ids = torch.randint(0, 64, (TOKENS,), generator=generator)
    logits, weights, experts = (
        reference(x.unsqueeze(0), ids.unsqueeze(0)) if hashed else reference(x.unsqueeze(0))
    )
    fixed = reference.tid2eid[ids] if hashed else None
    got_weights, got_ids = route(
        ours, logits.float(), None if hashed else reference.e_score_correction_bias, fixed
    )
    order, got_order = experts.sort(dim=-1), got_ids.sort(dim=-1)  # top-k's order is unspecified
    assert torch.equal(got_order.values, order.values)
    torch.testing.assert_close(
        got_weights.gather(1, got_order.indices),
        weights.gather(1, order.indices),
        rtol=0,
        atol=1e-6,
    )


WINDOW, LONG = 4, 11  # a prompt well past the window


RATES = {"compressed_sparse_attention": 2, "heavily_compressed_attention": 3}  # tokens per entry


def _attention_config(kind: str):  # type: ignore[no-untyped-def]
    from transformers import DeepseekV4Config

    made = DeepseekV4Config(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=STREAMS,
        layer_types=[kind],
        mlp_layer_types=["moe"],
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=4,
        index_head_dim=8,
        index_topk=2,
        sliding_window=WINDOW,
        partial_rotary_factor=0.5,
        compress_rates=dict(RATES),
    )
    made._attn_implementation = "eager"
    return made


NAMES = {
    "q_a_proj.weight": "q_a",
    "q_a_norm.weight": "q_a_norm",
    "q_b_proj.weight": "q_b",
    "kv_proj.weight": "kv",
    "kv_norm.weight": "kv_norm",
    "o_a_proj.weight": "o_a",
    "o_b_proj.weight": "o_b",
    "sinks": "sinks",
    "compressor.kv_proj.weight": "compressor.kv",
    "compressor.gate_proj.weight": "compressor.gate",
    "compressor.position_bias": "compressor.position_bias",
    "compressor.kv_norm.weight": "compressor.kv_norm",
    "compressor.indexer.kv_proj.weight": "indexer.compressor.kv",
    "compressor.indexer.gate_proj.weight": "indexer.compressor.gate",
    "compressor.indexer.position_bias": "indexer.compressor.position_bias",
    "compressor.indexer.kv_norm.weight": "indexer.compressor.kv_norm",
    "compressor.indexer.q_b_proj.weight": "indexer.q_b",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.weights",
}


def _attention_pair(config):  # type: ignore[no-untyped-def]
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    from seamline.model.v4_attention import Compression, V4Attention, V4AttentionShape

    reference = _randomised(DeepseekV4Attention(config, 0).float().eval(), 7)
    kind = config.layer_types[0]
    compressed = kind != "sliding_attention"
    rope = config.rope_parameters["compress" if compressed else "main"]
    shape = V4AttentionShape(
        HIDDEN,
        config.num_attention_heads,
        config.head_dim,
        config.q_lora_rank,
        config.o_groups,
        config.o_lora_rank,
        int(config.head_dim * rope["partial_rotary_factor"]),
        rope["rope_theta"],
        config.sliding_window,
        config.rms_norm_eps,
    )
    sparse = kind == "compressed_sparse_attention"
    compression = (
        Compression(
            RATES[kind], sparse, config.index_n_heads, config.index_head_dim, config.index_topk
        )
        if compressed
        else None
    )
    ours = V4Attention(shape, compression)
    for name, param in reference.named_parameters():
        owner, _, leaf = NAMES[name].rpartition(".")
        setattr(
            ours.get_submodule(owner),
            leaf,
            torch.nn.Parameter(param.detach().clone(), requires_grad=False),
        )
    return reference, ours


def _reference_attention(reference, config, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4RotaryEmbedding,
    )

    tokens = x.shape[0]
    positions = torch.arange(tokens).unsqueeze(0)
    rotary = DeepseekV4RotaryEmbedding(config)
    embeddings = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    distance = torch.arange(tokens)[:, None] - torch.arange(tokens)[None, :]
    mask = torch.zeros(tokens, tokens).masked_fill(
        (distance < 0) | (distance >= WINDOW), float("-inf")
    )
    with torch.no_grad():
        out, _ = reference(x.unsqueeze(0), embeddings, positions, mask.view(1, 1, tokens, tokens))
    return out[0]


@pytest.mark.parametrize(
    "kind", ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"]
)
def test_v4_attention_equals_the_reference_at_once_in_chunks_and_decoding(kind: str) -> None:
    """Over a prompt longer than the window (and 3 compression windows): all at once, in two
    chunks through the cache, and the last 3 positions decoded one at a time, each within 1e-5
    of the reference's rows."""
    from seamline.config import V4_REWIND_REACH
    from seamline.model.v4_attention import SlidingCache

    config = _attention_config(kind)
    reference, ours = _attention_pair(config)
    x = torch.randn(LONG, HIDDEN, generator=torch.Generator().manual_seed(8))
    expected = _reference_attention(reference, config, x)
    torch.testing.assert_close(ours(x, 0, SlidingCache()), expected, rtol=0, atol=1e-5)
    cache = SlidingCache()
    chunks = [ours(x[:5], 0, cache), ours(x[5:8], 5, cache)]
    chunks += [ours(x[p : p + 1], p, cache) for p in range(8, LONG)]
    torch.testing.assert_close(torch.cat(chunks), expected, rtol=0, atol=1e-5)
    assert (
        cache.length == LONG and cache.kv is not None
    )  # the window and the positions a rewind may take back
    assert cache.kv.shape[0] == min(LONG, WINDOW - 1 + V4_REWIND_REACH)
