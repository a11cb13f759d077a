"""DeepSeek-V4 as a ``Stage``: layers [start, end) of the model, with the embedding and/or
the hyper-head, norm and output head when owned (``model/stage.py`` is the other families').

Between stages crosses the residual, ``[tokens, hc_mult, hidden]`` (``boundary_shape``), and
the tokens' ids (``passes_ids``), which the hash-routed layers of every stage need.

The feed-forward of every layer is a mixture of experts: top-k of sqrt(softplus) scores plus a
correction bias (``moe``), or the experts a fixed table gives the token id (``hash_moe``); the
routed and shared experts clamp their SwiGLU inputs to ``swiglu_limit``. Attention runs per
span over that sequence's ``V4Cache``; everything else runs once over all rows of a step.

A V4 cache forgets the keys behind its window, so it cannot be forked at an earlier
position (``forks_caches``): a prompt that begins as another is computed afresh. It keeps
``V4_REWIND_REACH`` positions more than its window needs, so a step may start up to that many
positions back (a speculative window's rejected drafts: ``verifies_drafts``).
With ``mtp`` a stage that owns the head runs the model's multi-token-prediction layer
(``model/v4_mtp.py``, checkpoint tensors ``mtp.0.*``), which drafts; else those are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from seamline.config import ModelConfig, v4_cache_bytes
from seamline.model.cache import Span
from seamline.model.devices import from_host, module_device
from seamline.model.hyper import HyperConnection, HyperHead, widen
from seamline.model.layers import RMSNorm, empty_param
from seamline.model.linear import Weight, embedding, linear, select
from seamline.model.moe import route
from seamline.model.v4_attention import Compression, SlidingCache, V4Attention
from seamline.model.v4_mtp import V4NextTokenLayer
from seamline.model.v4_parts import V4AttentionShape, weighted_rms
from seamline.ownership import Ownership, v4_head_groups
from seamline.parallel.comm import Comm, GateTag, SingleComm

HF = Mapping[str, Any]


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class V4MoE(nn.Module):
    """Routed experts [e0, e1) of the ownership and its rows of the shared experts: in a
    lockstep group each rank's output is its part of the sum (routing is computed whole)."""

    def __init__(self, config: ModelConfig, hashed: bool, own: Ownership) -> None:
        super().__init__()
        self.routing, self.limit = config, float(config.hf["swiglu_limit"])
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.first, last = own.expert_range(config)
        s0, s1 = own.shard_rows(inter * config.n_shared_experts)
        self.router = empty_param(config.num_experts, hidden)
        self.table = (
            empty_param(config.vocab_size, config.num_experts_per_tok) if hashed else None
        )  # tid2eid
        self.router_bias = None if hashed else empty_param(config.num_experts)
        self.experts_gate_up = empty_param(last - self.first, 2 * inter, hidden)
        self.experts_down = empty_param(last - self.first, hidden, inter)
        self.shared_gate_up = empty_param(2 * (s1 - s0), hidden)
        self.shared_down = empty_param(hidden, s1 - s0)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.router)
        fixed = self.table[ids] if self.table is not None else None
        weights, chosen = route(self.routing, logits, self.router_bias, fixed)
        out = torch.zeros_like(x)
        owned = range(self.first, self.first + self.experts_down.shape[0])
        for expert in chosen.unique().tolist():
            if expert not in owned:
                continue  # another rank's
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            local = expert - self.first
            h = clamped_swiglu(linear(x[rows], select(self.experts_gate_up, local)), self.limit)
            out.index_add_(
                0,
                rows,
                linear(h, select(self.experts_down, local)) * weights[rows, slot, None].to(x.dtype),
            )
        return out + linear(
            clamped_swiglu(linear(x, self.shared_gate_up), self.limit), self.shared_down
        )


class V4Block(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        own: Ownership,
        comm: Comm,
        kinds: tuple[str, str] | None = None,
    ) -> None:
        """``kinds``: its attention and feed-forward kinds where the config's lists do not name
        them (the multi-token-prediction layer's)."""
        super().__init__()
        hf = config.hf
        kind, mlp_kind = (
            kinds if kinds is not None else (hf["layer_types"][layer], hf["mlp_layer_types"][layer])
        )
        hidden, streams, eps = config.hidden_size, int(hf["hc_mult"]), config.rms_norm_eps
        self.layer, self.comm, self.eps = layer, comm, eps
        self.attn_hc = HyperConnection(hidden, streams, hf["hc_sinkhorn_iters"], hf["hc_eps"], eps)
        self.ffn_hc = HyperConnection(hidden, streams, hf["hc_sinkhorn_iters"], hf["hc_eps"], eps)
        self.input_norm, self.post_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.attn = V4Attention(_shape(config, kind, own), _compression(hf, kind))
        self.ffn = V4MoE(config, mlp_kind == "hash_moe", own)

    def forward(
        self, residual: torch.Tensor, ids: torch.Tensor, spans: Sequence[Span], step: int
    ) -> torch.Tensor:
        collapsed, post, comb = self.attn_hc.mixes(residual)
        x = weighted_rms(collapsed, self.input_norm.weight, self.eps)
        out = torch.cat(
            [self.attn(x[s.offset : s.end], s.start, s.cache.layer(self.layer)) for s in spans]
        )
        residual = HyperConnection.spread(residual, self._gate(out, 0, step), post, comb)
        collapsed, post, comb = self.ffn_hc.mixes(residual)
        out = self.ffn(weighted_rms(collapsed, self.post_norm.weight, self.eps), ids)
        return HyperConnection.spread(residual, self._gate(out, 1, step), post, comb)

    def _gate(self, partial: torch.Tensor, gate: int, step: int) -> torch.Tensor:
        if self.comm.world == 1:
            return partial
        return self.comm.all_reduce(partial, GateTag(self.layer, gate, step))


def _shape(config: ModelConfig, kind: str, own: Ownership) -> V4AttentionShape:
    """The attention this ownership computes: its query heads, whole output groups of them
    (``v4_head_groups``); the shared key/value head and the compressors are every rank's."""
    hf = config.hf
    rope = hf["rope_parameters"]["main" if kind == "sliding_attention" else "compress"]
    g0, g1 = v4_head_groups(config, own)
    return V4AttentionShape(
        config.hidden_size,
        config.num_heads * (g1 - g0) // int(hf["o_groups"]),
        config.head_dim,
        int(hf["q_lora_rank"]),
        g1 - g0,
        int(hf["o_lora_rank"]),
        int(config.head_dim * rope["partial_rotary_factor"]),
        float(rope["rope_theta"]),
        int(hf["sliding_window"]),
        config.rms_norm_eps,
    )


def _compression(hf: HF, kind: str) -> Compression | None:
    if kind == "sliding_attention":
        return None
    sparse = kind == "compressed_sparse_attention"
    return Compression(
        int(hf["compress_rates"][kind]),
        sparse,
        int(hf.get("index_n_heads") or 0),
        int(hf.get("index_head_dim") or 0),
        int(hf.get("index_topk") or 0),
    )


class V4Cache:
    """One sequence's state for the V4 layers one process owns: each layer's window of keys
    and its compressors' state."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = {i: SlidingCache() for i in layers}
        self.draft_pending: tuple[int, torch.Tensor] | None = None  # as SequenceCache's

    def layer(self, index: int) -> SlidingCache:
        return self.layers[index]

    def nbytes(self) -> int:
        return sum(cache.nbytes() for cache in self.layers.values())


class V4Stage(nn.Module):
    forks_caches = False  # see the module docstring
    passes_ids = True
    verifies_drafts = (
        True  # a step may start within V4_REWIND_REACH positions before the cache's end
    )

    def __init__(
        self, config: ModelConfig, own: Ownership, comm: Comm | None = None, mtp: bool = False
    ) -> None:
        """``mtp``: with the model's multi-token-prediction layer, which drafts (``model/v4_mtp.py``;
        a stage that owns the whole head, alone in its group)."""
        super().__init__()
        own.validate(config)
        self.config, self.ownership = config, own
        self.comm: Comm = comm if comm is not None else SingleComm()
        self.step = 0
        hidden, self.streams = config.hidden_size, int(config.hf["hc_mult"])
        self.boundary_shape = (self.streams, hidden)
        self.embed: Weight | None = (
            empty_param(config.vocab_size, hidden) if own.owns_embedding() else None
        )
        self.layers = nn.ModuleDict(
            {str(i): V4Block(config, i, own, self.comm) for i in own.layer_indices()}
        )
        owns_head = own.owns_head(config)
        self.hc_head = (
            HyperHead(hidden, self.streams, config.hf["hc_eps"], config.rms_norm_eps)
            if owns_head
            else None
        )
        self.norm = RMSNorm(hidden, config.rms_norm_eps) if owns_head else None
        v0, v1 = own.vocab_range(config)
        self.head: Weight | None = empty_param(v1 - v0, hidden) if owns_head else None
        self.mtp: V4NextTokenLayer | None = V4NextTokenLayer(config, own) if mtp else None
        self.hidden: torch.Tensor | None = (
            None  # with ``mtp``: the last forward's residual rows before the head
        )
        # the layers a sequence's cache holds: the owned ones and the drafting layer's
        self.cache_layers = [
            *own.layer_indices(),
            *([self.mtp.layer] if self.mtp is not None else []),
        ]

    @torch.inference_mode()
    def draft_states(
        self, states: torch.Tensor, next_ids: torch.Tensor, spans: Sequence[Span]
    ) -> torch.Tensor:
        """The drafting layer over residual rows ``states`` [N, hc_mult, hidden] and the tokens
        after them ``next_ids`` [N], at the spans' positions: its output [N, hc_mult, hidden]."""
        assert self.mtp is not None
        table = self.embed if self.embed is not None else self.mtp.embed
        assert table is not None
        return self.mtp(states, embedding(next_ids, table, self.compute_dtype), next_ids, spans)

    @torch.inference_mode()
    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """The logits [rows, vocab] of drafting-layer outputs: the token after next."""
        assert self.mtp is not None and self.head is not None
        return linear(self.mtp.logits_input(outputs), self.head)

    @property
    def compute_dtype(self) -> torch.dtype:
        block = next(iter(self.layers.values()))
        assert isinstance(block, V4Block)
        return block.input_norm.weight.dtype

    @property
    def input_device(self) -> torch.device:
        """Where a step's input goes: the stage's one device."""
        return module_device(self)

    def new_cache(self, greedy: bool = False) -> V4Cache:
        return V4Cache(self.cache_layers)

    def release_cache(self, cache: V4Cache) -> None:
        """A finished sequence's cache: garbage here."""

    def cache_bytes(self, tokens: int) -> int:
        """The most one sequence of ``tokens`` holds in this stage's caches."""
        size = torch.finfo(self.compute_dtype).bits // 8
        return v4_cache_bytes(self.config, self.cache_layers, tokens, size)

    def forward(
        self,
        inputs: torch.Tensor,
        start: int,
        cache: V4Cache,
        last_only: bool = False,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.forward_batch(inputs, [Span(0, inputs.shape[0], start, cache)], last_only, ids)  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward_batch(
        self,
        inputs: torch.Tensor,
        spans: Sequence[Span],
        last_only: bool = False,
        ids: torch.Tensor | None = None,
        logit_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """inputs: ids [N] (the first stage) or the residual [N, hc_mult, hidden] with the
        rows' ``ids``. Returns the residual for the next stage, or logits [N, vocab] (with
        ``last_only``: each span's last row; with ``logit_rows``: those rows')."""
        device = self.input_device  # one device for the whole stage (no GPU/CPU span here)
        inputs = from_host(inputs, device)
        ids = from_host(ids, device) if ids is not None else None
        if self.embed is not None:
            ids = inputs
            residual = widen(embedding(inputs, self.embed, self.compute_dtype), self.streams)
        elif ids is None:
            raise ValueError(
                f"layers from {self.ownership.layers[0]} on need the tokens' ids with the residual"
            )
        else:
            residual = inputs
        step, self.step = self.step, self.step + 1
        for block in self.layers.values():
            residual = block(residual, ids, spans, step)
        if self.head is None or self.hc_head is None or self.norm is None:
            return residual
        if self.mtp is not None:  # the drafting layer reads every row's last residual
            self.hidden = residual
        if logit_rows is not None or last_only:
            residual = residual[
                list(logit_rows) if logit_rows is not None else [s.end - 1 for s in spans]
            ]
        return linear(
            weighted_rms(self.hc_head(residual), self.norm.weight, self.config.rms_norm_eps),
            self.head,
        )


def boundary_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes per token crossing a stage boundary: the residual's streams and the token's id."""
    return int(config.hf["hc_mult"]) * config.hidden_size * dtype.itemsize + ID_BYTES


ID_BYTES = 4  # a token id on the wire (int32)
