"""DeepSeek-V4 in one process: the blocks assembled (hyper-connections around V4 attention and
its mixture of experts), for checking the parts against the reference as a whole.

Not yet a ``Stage``: the mesh's stages, lockstep ranks, batched spans and the checkpoint
loader do not take V4 yet. ``load_reference_weights`` fills it from a state dict under
transformers' names.

The feed-forward of every layer is a mixture of experts: top-k of sqrt(softplus) scores plus a
correction bias (``moe``), or the experts a fixed table gives the token id (``hash_moe``); the
routed and shared experts clamp their SwiGLU inputs to ``swiglu_limit``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seamline.config import ModelConfig
from seamline.errors import CheckpointError
from seamline.model.hyper import HyperConnection, HyperHead, widen
from seamline.model.layers import empty_param
from seamline.model.moe import route
from seamline.model.v4_attention import Compression, SlidingCache, V4Attention
from seamline.model.v4_parts import V4AttentionShape, weighted_rms

ROUTING = dict(scoring_func="sqrtsoftplus", topk_method="noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class V4MoE(nn.Module):
    def __init__(self, hc: dict, hashed: bool) -> None:  # type: ignore[type-arg]
        super().__init__()
        self.hashed, self.top_k, self.limit = hashed, hc["num_experts_per_tok"], hc["swiglu_limit"]
        experts, hidden, inter = hc["n_routed_experts"], hc["hidden_size"], hc["moe_intermediate_size"]
        self.routing = ModelConfig(family="deepseek_v4", vocab_size=hc["vocab_size"], hidden_size=hidden,
                                   intermediate_size=inter, num_layers=hc["num_hidden_layers"],
                                   num_heads=hc["num_attention_heads"], num_kv_heads=1, head_dim=hc["head_dim"],
                                   num_experts=experts, num_experts_per_tok=self.top_k, moe_intermediate_size=inter,
                                   routed_scaling_factor=hc["routed_scaling_factor"], **ROUTING)  # type: ignore[arg-type]  # fmt: skip
        self.router = empty_param(experts, hidden)
        self.table = empty_param(hc["vocab_size"], self.top_k) if hashed else None  # tid2eid
        self.bias = None if hashed else empty_param(experts)
        self.experts_gate_up = empty_param(experts, 2 * inter, hidden)
        self.experts_down = empty_param(experts, hidden, inter)
        self.shared_gate_up = empty_param(2 * inter, hidden)
        self.shared_down = empty_param(hidden, inter)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.router.float())
        fixed = self.table[ids] if self.table is not None else None
        weights, chosen = route(self.routing, logits, self.bias, fixed)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            h = clamped_swiglu(F.linear(x[rows], self.experts_gate_up[expert]), self.limit)
            out.index_add_(0, rows, F.linear(h, self.experts_down[expert]) * weights[rows, slot, None].to(x.dtype))
        return out + F.linear(clamped_swiglu(F.linear(x, self.shared_gate_up), self.limit), self.shared_down)


class V4Block(nn.Module):
    def __init__(self, hc: dict, kind: str, hashed: bool) -> None:  # type: ignore[type-arg]
        super().__init__()
        hidden, streams, eps = hc["hidden_size"], hc["hc_mult"], hc["rms_norm_eps"]
        self.attn_hc = HyperConnection(hidden, streams, hc["hc_sinkhorn_iters"], hc["hc_eps"], eps)
        self.ffn_hc = HyperConnection(hidden, streams, hc["hc_sinkhorn_iters"], hc["hc_eps"], eps)
        self.input_norm, self.post_norm, self.eps = empty_param(hidden), empty_param(hidden), eps
        self.attn = V4Attention(_shape(hc, kind), _compression(hc, kind))
        self.moe = V4MoE(hc, hashed)

    def forward(self, residual: torch.Tensor, ids: torch.Tensor, start: int, cache: SlidingCache) -> torch.Tensor:
        collapsed, post, comb = self.attn_hc.mixes(residual)
        out = self.attn(weighted_rms(collapsed, self.input_norm, self.eps), start, cache)
        residual = HyperConnection.spread(residual, out, post, comb)
        collapsed, post, comb = self.ffn_hc.mixes(residual)
        out = self.moe(weighted_rms(collapsed, self.post_norm, self.eps), ids)
        return HyperConnection.spread(residual, out, post, comb)


def _shape(hc: dict, kind: str) -> V4AttentionShape:  # type: ignore[type-arg]
    rope = hc["rope_parameters"]["main" if kind == "sliding_attention" else "compress"]
    return V4AttentionShape(hc["hidden_size"], hc["num_attention_heads"], hc["head_dim"], hc["q_lora_rank"],
                            hc["o_groups"], hc["o_lora_rank"], int(hc["head_dim"] * rope["partial_rotary_factor"]),
                            rope["rope_theta"], hc["sliding_window"], hc["rms_norm_eps"])  # fmt: skip


def _compression(hc: dict, kind: str) -> Compression | None:  # type: ignore[type-arg]
    if kind == "sliding_attention":
        return None
    sparse = kind == "compressed_sparse_attention"
    return Compression(hc["compress_rates"][kind], sparse, hc["index_n_heads"], hc["index_head_dim"], hc["index_topk"])


class V4Model(nn.Module):
    """Layers [first, end) of the model (all by default), with the embedding when first is 0
    and the hyper-head, norm and output head when end is the last; ``hc``: its Hugging Face
    config as a dict (``DeepseekV4Config.to_dict``).

    Between two such stages crosses the residual, ``[tokens, hc_mult, hidden]``, and the
    tokens' ids, which the hash-routed layers of every stage need (``boundary_bytes``)."""

    def __init__(self, hc: dict, layers: tuple[int, int] | None = None) -> None:  # type: ignore[type-arg]
        super().__init__()
        hidden, streams, count = hc["hidden_size"], hc["hc_mult"], hc["num_hidden_layers"]
        self.first, end = layers or (0, count)
        self.streams, self.eps = streams, hc["rms_norm_eps"]
        kinds = list(zip(hc["layer_types"], hc["mlp_layer_types"]))[self.first : end]
        self.embed = empty_param(hc["vocab_size"], hidden) if self.first == 0 else None
        self.layers = nn.ModuleList(V4Block(hc, kind, mlp == "hash_moe") for kind, mlp in kinds)
        owns_head = end == count
        self.hc_head = HyperHead(hidden, streams, hc["hc_eps"], self.eps) if owns_head else None
        self.norm = empty_param(hidden) if owns_head else None
        self.head = empty_param(hc["vocab_size"], hidden) if owns_head else None

    def new_caches(self) -> list[SlidingCache]:
        return [SlidingCache() for _ in self.layers]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, caches: list[SlidingCache],
                residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Token ids [T] at positions [start, start + T), and the residual [T, hc_mult, hidden]
        from the stage before (none for the first) -> logits [T, vocab], or the residual for
        the next stage."""
        if self.embed is not None:
            residual = widen(F.embedding(ids, self.embed), self.streams)
        if residual is None:
            raise ValueError(f"layers from {self.first} on need the residual of the layers before")
        for block, cache in zip(self.layers, caches):
            residual = block(residual, ids, start, cache)
        if self.hc_head is None or self.norm is None or self.head is None:
            return residual
        return F.linear(weighted_rms(self.hc_head(residual), self.norm, self.eps), self.head)


def boundary_bytes(hc: dict, dtype: torch.dtype) -> int:  # type: ignore[type-arg]
    """Bytes per token crossing a stage boundary: the residual's streams and the token's id."""
    return hc["hc_mult"] * hc["hidden_size"] * torch.empty(0, dtype=dtype).element_size() + 8


def load_reference_weights(model: V4Model, state: dict[str, torch.Tensor]) -> None:
    """Fill ``model`` from a state dict under transformers' names: every tensor of its layers
    (renumbered from ``model.first``), embedding and head goes in, and every parameter is filled."""
    params = dict(model.named_parameters())
    for name, value in _fuse_shared(state).items():
        ours = _renumbered(_our_name(name), model.first, len(model.layers))
        if ours is None or getattr(model, ours.split(".")[0]) is None:
            continue  # another stage's
        if ours not in params:
            raise CheckpointError(f"{name} has no place in the V4 model (as {ours})")
        if tuple(value.shape) != tuple(params[ours].shape):
            raise CheckpointError(f"{name} has shape {tuple(value.shape)}; the config needs {tuple(params[ours].shape)}")
        owner, _, leaf = ours.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(_our_value(ours, value), requires_grad=False))
    missing = {n for n, p in model.named_parameters() if p.is_meta}
    if missing:
        raise CheckpointError(f"the checkpoint has no tensor for {sorted(missing)[0]} (and {len(missing) - 1} more)")


_PLAIN = {"q_a_proj": "q_a", "q_b_proj": "q_b", "kv_proj": "kv", "o_a_proj": "o_a", "o_b_proj": "o_b",
          "gate_proj": "gate", "q_a_norm": "q_a_norm", "kv_norm": "kv_norm"}  # fmt: skip


def _our_name(name: str) -> str:
    name = name.removeprefix("model.")
    fixed = {"embed_tokens.weight": "embed", "norm.weight": "norm", "lm_head.weight": "head", "hc_head.hc_fn": "hc_head.fn",
             "hc_head.hc_base": "hc_head.base", "hc_head.hc_scale": "hc_head.scale"}  # fmt: skip
    if name in fixed:
        return fixed[name]
    for theirs, ours in (("self_attn.compressor.indexer.scorer.weights_proj", "attn.indexer.weights"),
                         ("self_attn.compressor.indexer.", "attn.indexer.compressor."), ("self_attn.", "attn."),
                         ("input_layernorm.weight", "input_norm"), ("post_attention_layernorm.weight", "post_norm"),
                         ("mlp.gate.weight", "moe.router"), ("mlp.gate.e_score_correction_bias", "moe.bias"),
                         ("mlp.gate.tid2eid", "moe.table"), ("mlp.experts.gate_up_proj", "moe.experts_gate_up"),
                         ("mlp.experts.down_proj", "moe.experts_down")):  # fmt: skip
        name = name.replace(theirs, ours)
    name = name.replace("attn.indexer.compressor.q_b_proj", "attn.indexer.q_b")
    for theirs, ours in _PLAIN.items():
        name = name.replace(f".{theirs}.weight", f".{ours}")
    return name.removesuffix(".weight")


def _renumbered(name: str, first: int, count: int) -> str | None:
    """``layers.i.…`` as this stage's ``layers.(i - first).…``; another stage's layer: None."""
    parts = name.split(".")
    if parts[0] == "layers":
        index = int(parts[1]) - first
        if not 0 <= index < count:
            return None
        parts[1] = str(index)
    return ".".join(parts)


def _fuse_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The shared expert's gate and up rows as one matrix (gate first), as ours holds them."""
    fused = {}
    for name, value in state.items():
        if ".mlp.shared_experts.up_proj." in name:
            continue
        if ".mlp.shared_experts.gate_proj." in name:
            up = state[name.replace("gate_proj", "up_proj")]
            fused[name.replace("mlp.shared_experts.gate_proj.weight", "moe.shared_gate_up")] = torch.cat([value, up])
        elif ".mlp.shared_experts.down_proj." in name:
            fused[name.replace("mlp.shared_experts.down_proj.weight", "moe.shared_down")] = value
        else:
            fused[name] = value
    return fused


def _our_value(name: str, value: torch.Tensor) -> torch.Tensor:
    return value.detach().clone().float() if not name.endswith("moe.table") else value.detach().clone()
