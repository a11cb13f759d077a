"""Mixture-of-experts feed-forward: Mixtral, Qwen3-MoE and DeepSeek-V2/V3 routing.

The router is replicated, so every rank routes each token over all E experts; the module
holds only its owned experts [e0, e1) and the owned rows of the shared experts, and returns
its partial sum. The ranks' outputs add up to the full layer's output (the caller sums).

Routing (matching transformers' reference code):
  scores  = softmax(logits) | sigmoid(logits) | sqrt(softplus(logits)) (scoring_func; or
            topk_softmax: softmax over the top-k logits alone, gpt-oss's, ``moe_oss.py``)
  choose  = top-k of scores                                          greedy
          | top-k within the topk_group groups of highest max score  group_limited_greedy
          | top-k of scores + bias within the topk_group groups of
            highest (sum of the top-2 biased scores)                 noaux_tc (DeepSeek-V3;
                                                                      V4: one group)
          | the token's row of a fixed table (``fixed_ids``)         hash routing (DeepSeek-V4)
  weights = the chosen unbiased scores, / their sum if norm_topk_prob, × routed_scaling_factor

Shared experts are held whole by every rank of a group and split by intermediate rows. A
prefill splits them evenly. A decode step splits them by that token's routing: the ranks with
fewer of its chosen experts take more shared rows (``balance_rows``), so the busiest rank's
work is as small as the fixed expert ranges allow. Every rank routes the same token with the
same replicated router, so all compute the same split with no message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from seamline.config import ModelConfig
from seamline.errors import ConfigError
from seamline.model.fused import silu_mul
from seamline.model.layers import GatedMLP, empty_param
from seamline.model.linear import granule, linear, select
from seamline.ownership import Ownership

SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus", "topk_softmax")  # topk_softmax: gpt-oss's
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


def balance_rows(loads: Sequence[int], rows: int) -> list[tuple[int, int]]:
    """Split ``rows`` rows among ranks that already carry ``loads`` rows of work, so the
    busiest total is as small as it can be: contiguous ranges in rank order. Integer and
    deterministic, so every rank computes the same split."""
    low, high = min(loads), max(loads) + rows
    while low < high:  # the lowest level that the rows can fill every rank up to
        mid = (low + high) // 2
        if sum(max(0, mid - load) for load in loads) >= rows:
            high = mid
        else:
            low = mid + 1
    shares = [max(0, low - load) for load in loads]
    excess = sum(shares) - rows  # fewer than the ranks filled: each gives back one at most,
    for rank in range(len(shares)):  # the leader (rank 0, which also drives the group) first
        give = min(excess, shares[rank], 1)
        shares[rank] -= give
        excess -= give
    ranges, start = [], 0
    for share in shares:
        ranges.append((start, start + share))
        start += share
    return ranges


def _scores(scoring_func: str, logits: torch.Tensor) -> torch.Tensor:
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(dim=-1)


def route(
    config: ModelConfig,
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    fixed_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64). With
    ``fixed_ids`` [T, k] (hash routing: a table's rows for the tokens' ids) the experts are
    those, and only their weights come from the scores."""
    k, groups = config.num_experts_per_tok, config.n_group
    if config.scoring_func == "topk_softmax":  # the top-k logits, then a softmax over them alone
        top, ids = torch.topk(logits, k=k, dim=-1)
        return top.softmax(dim=-1), ids
    scores = _scores(config.scoring_func, logits)
    if fixed_ids is not None:
        ids = fixed_ids.long()
        weights = scores.gather(1, ids)
    elif config.topk_method == "noaux_tc":
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
        self.router_logit_bias: nn.Parameter | None = (
            None  # a router's own bias (gpt-oss: ``moe_oss.py``)
        )
        self.experts_gate_up = empty_param(self.owned, 2 * inter, hidden)  # gate rows, then up rows
        self.experts_down = empty_param(self.owned, hidden, inter)
        self.inter = inter
        self.rank, self.world = own.shard
        self.per_rank = config.num_experts // self.world
        # Balancing needs every rank's expert range: the even split rank_ownership makes.
        even = (self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        self.balanced = self.world > 1 and (self.first, end) == even
        self.shared: GatedMLP | None = None
        if config.n_shared_experts:
            self.shared = GatedMLP(hidden, config.n_shared_experts * inter)  # whole on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> this rank's partial output [..., hidden]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, hidden]
        # Route in float32; a float32 router (if the loader keeps one) sees float32 input.
        logits = F.linear(
            x.to(self.router.dtype), self.router, self.router_logit_bias
        ).float()  # [T, E]
        bias = self.router_bias.float() if self.router_bias is not None else None
        weights, ids = route(self.config, logits, bias)
        weights = weights.to(x.dtype)
        chosen = ids[0].tolist() if x.shape[0] == 1 else None
        if chosen is not None:
            out = self._one_token(x, weights, chosen)
        else:
            out = self._many_tokens(x, weights, ids)
        if self.shared is not None:
            start, end = self._shared_rows(chosen)
            if end > start:
                out = out + self.shared.rows_forward(x, start, end)
        return out.reshape(shape)

    def _shared_rows(self, chosen: list[int] | None) -> tuple[int, int]:
        """This rank's shared-expert rows: by the ``chosen`` experts of one token (decode),
        else an even split; in whole blocks of a quantized ``down`` (``step``)."""
        assert self.shared is not None
        step = granule(self.shared.down)
        units, rank, world = self.shared.rows // step, self.rank, self.world
        if not self.balanced or chosen is None:
            return (rank * units // world * step, (rank + 1) * units // world * step)
        counts = [0] * world
        for expert in chosen:
            counts[expert // self.per_rank] += 1
        start, end = balance_rows([c * self.inter // step for c in counts], units)[rank]
        return start * step, end * step

    def _expert(self, x: torch.Tensor, local: int) -> torch.Tensor:
        """Owned expert ``local`` on x [n, hidden] -> [n, hidden] (weights indexed as views)."""
        gate_up = linear(x, select(self.experts_gate_up, local))  # [n, 2*inter]
        return linear(silu_mul(gate_up), select(self.experts_down, local))

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, chosen: list[int]) -> torch.Tensor:
        """Decode: loop over the k chosen experts only, skipping those another rank owns."""
        out = torch.zeros_like(x)
        for slot, expert in enumerate(chosen):
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
