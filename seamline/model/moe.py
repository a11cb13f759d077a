"""Mixture-of-experts feed-forward: Mixtral, Qwen3-MoE and DeepSeek-V2/V3 routing.

The router is replicated, so every rank routes each token over all E experts; the module
holds only its owned experts [e0, e1) and the owned rows of the shared experts, and returns
its partial sum. The ranks' outputs add up to the full layer's output (the caller sums).

Routing (matching transformers' reference code):
  scores  = softmax(logits) | sigmoid(logits)                       (scoring_func)
  choose  = top-k of scores                                          greedy
          | top-k within the topk_group groups of highest max score  group_limited_greedy
          | top-k of scores + bias within the topk_group groups of
            highest (sum of the top-2 biased scores)                 noaux_tc (DeepSeek-V3)
  weights = the chosen unbiased scores, / their sum if norm_topk_prob, × routed_scaling_factor
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seamline.config import ModelConfig
from seamline.errors import ConfigError
from seamline.model.layers import GatedMLP, empty_param
from seamline.model.ownership import Ownership

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def check_routing(config: ModelConfig) -> None:
    """Raise ConfigError unless the routing fields describe a routable MoE."""
    experts, k = config.num_experts, config.num_experts_per_tok
    if config.scoring_func not in SCORING_FUNCS:
        raise ConfigError(f"scoring_func {config.scoring_func!r} is not one of {SCORING_FUNCS}")
    if config.topk_method not in TOPK_METHODS:
        raise ConfigError(f"topk_method {config.topk_method!r} is not one of {TOPK_METHODS}")
    if not 0 < k <= experts:
        raise ConfigError(f"num_experts_per_tok {k} must be in [1, num_experts={experts}]")
    if config.moe_intermediate_size <= 0:
        raise ConfigError("moe_intermediate_size must be positive in an MoE layer")
    if config.topk_method == "greedy":
        return
    groups, keep = config.n_group, config.topk_group
    if groups <= 0 or experts % groups:
        raise ConfigError(f"num_experts {experts} must divide into n_group={groups} groups")
    if not 0 < keep <= groups:
        raise ConfigError(f"topk_group {keep} must be in [1, n_group={groups}]")
    per_group = experts // groups
    if config.topk_method == "noaux_tc" and (per_group < 2 or k > keep * per_group):
        raise ConfigError(
            f"noaux_tc needs >= 2 experts per group and top-k {k} <= topk_group*experts/group "
            f"= {keep * per_group}"
        )


def _group_mask(choice: torch.Tensor, group_score: torch.Tensor, keep: int) -> torch.Tensor:
    """[T, E] bool: True for experts in the ``keep`` best groups. group_score: [T, G]."""
    tokens, groups = group_score.shape
    best = torch.topk(group_score, k=keep, dim=-1, sorted=False)[1]  # [T, keep]
    mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    per_group = choice.shape[-1] // groups
    return mask.unsqueeze(-1).expand(tokens, groups, per_group).reshape(choice.shape)


def route(
    config: ModelConfig, logits: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64)."""
    k, groups = config.num_experts_per_tok, config.n_group
    scores = logits.sigmoid() if config.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    if config.topk_method == "noaux_tc":
        if bias is None:
            raise ConfigError("topk_method noaux_tc needs a router bias (e_score_correction_bias)")
        choice = scores + bias  # [T, E]
        grouped = choice.view(choice.shape[0], groups, -1)  # [T, G, E/G]
        mask = _group_mask(choice, grouped.topk(2, dim=-1)[0].sum(dim=-1), config.topk_group)
        ids = torch.topk(choice.masked_fill(~mask, float("-inf")), k=k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    elif config.topk_method == "group_limited_greedy":
        grouped = scores.view(scores.shape[0], groups, -1)  # [T, G, E/G]
        mask = _group_mask(scores, grouped.max(dim=-1).values, config.topk_group)
        weights, ids = torch.topk(scores.masked_fill(~mask, 0.0), k=k, dim=-1, sorted=False)
    else:
        weights, ids = torch.topk(scores, k=k, dim=-1)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, ids


class MoE(nn.Module):
    """Routed experts [e0, e1) plus this shard's rows of the shared experts (DeepSeek)."""

    def __init__(self, config: ModelConfig, own: Ownership) -> None:
        super().__init__()
        check_routing(config)
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.config = config
        self.first, end = own.expert_range(config)
        self.owned = end - self.first
        self.router = empty_param(config.num_experts, hidden)  # replicated
        biased = config.topk_method == "noaux_tc"
        self.router_bias = empty_param(config.num_experts) if biased else None
        self.experts_gate_up = empty_param(self.owned, 2 * inter, hidden)  # gate rows, then up rows
        self.experts_down = empty_param(self.owned, hidden, inter)
        self.inter = inter
        self.shared: GatedMLP | None = None
        if config.n_shared_experts:
            r0, r1 = own.shard_rows(config.n_shared_experts * inter)
            self.shared = GatedMLP(hidden, r1 - r0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> this rank's partial output [..., hidden]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, hidden]
        # Route in float32; a float32 router (if the loader keeps one) sees float32 input.
        logits = F.linear(x.to(self.router.dtype), self.router).float()  # [T, E]
        bias = self.router_bias.float() if self.router_bias is not None else None
        weights, ids = route(self.config, logits, bias)
        weights = weights.to(x.dtype)
        if x.shape[0] == 1:
            out = self._one_token(x, weights, ids)
        else:
            out = self._many_tokens(x, weights, ids)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)

    def _expert(self, x: torch.Tensor, local: int) -> torch.Tensor:
        """Owned expert ``local`` on x [n, hidden] -> [n, hidden] (weights indexed as views)."""
        gate_up = F.linear(x, self.experts_gate_up[local])  # [n, 2*inter]
        gate, up = gate_up.split(self.inter, dim=-1)
        return F.linear(F.silu(gate) * up, self.experts_down[local])

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Decode: loop over the k chosen experts only, skipping those another rank owns."""
        out = torch.zeros_like(x)
        for slot, expert in enumerate(ids[0].tolist()):
            local = expert - self.first
            if 0 <= local < self.owned:
                out = out + weights[0, slot] * self._expert(x, local)
        return out

    def _many_tokens(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Prefill: group the (token, slot) pairs by expert; run each owned, hit expert once."""
        k = ids.shape[1]
        flat = ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs sorted by expert
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        flat_weights = weights.reshape(-1)  # [T*k]
        out = torch.zeros_like(x)
        offset = sum(counts[: self.first])
        for local in range(self.owned):
            count = counts[self.first + local]
            if count == 0:
                continue
            pairs = order[offset : offset + count]  # [n]
            offset += count
            tokens = pairs // k
            y = self._expert(x[tokens], local) * flat_weights[pairs].unsqueeze(-1)
            out.index_add_(0, tokens, y)
        return out
