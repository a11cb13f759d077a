"""Stage: the layers [start, end) of one model, plus the embedding and/or head if owned.

With ``Ownership.full`` a Stage is the whole model. Input is token ids [T] when the stage
owns the embedding, else the residual stream [T, hidden]; output is logits [T, vocab_owned]
when it owns the head, else the residual stream for the next stage.

``forward_batch`` runs one step over the rows of many sequences (``Span``: decode rows and
prefill chunks mixed): every weight is multiplied once for all rows, attention runs per span
over that sequence's own cache, and MoE groups all rows by expert. ``forward`` is its case
of one sequence.

In a lockstep group (``Ownership.shard`` with world N) each rank's attention and
feed-forward return partial sums; a Block all-reduces each through ``comm`` (gate 0 after
attention, gate 1 after the feed-forward) before the residual add, so every rank keeps the
same residual stream. Tags are GateTag(layer, gate, step), step counting this Stage's
forwards. The default comm is ``SingleComm`` (one rank: the gates are no-ops).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from seamline.config import ModelConfig, RopeScaling, kv_bytes_per_token, ring_size
from seamline.model.attention import GQAttention
from seamline.model.cache import SequenceCache, Span
from seamline.model.devices import from_host
from seamline.model.layers import GatedMLP, RMSNorm, empty_param
from seamline.model.linear import Weight, embedding, linear
from seamline.model.rope import RotaryTable
from seamline.ownership import Ownership
from seamline.parallel.comm import Comm, GateTag, SingleComm

if TYPE_CHECKING:
    from seamline.model.mtp import NextTokenLayer


def make_rope(config: ModelConfig, local: bool = False) -> RotaryTable:
    """``local``: the sliding layers' own table (Gemma 3: its base, no scaling)."""
    dim = config.qk_rope_head_dim if config.is_mla else config.rotary_dim or config.head_dim
    if local:
        return RotaryTable(
            dim, config.local_rope_theta, RopeScaling(), config.max_position_embeddings
        )
    return RotaryTable(dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)


def make_attention(
    config: ModelConfig, rope: RotaryTable, own: Ownership, layer: int = -1
) -> nn.Module:
    """``layer``: its index, for a sliding window (-1: none, as the drafting layer's)."""
    if config.is_mla:
        from seamline.model.mla import MLAttention

        return MLAttention(config, rope, own)
    return GQAttention(
        config, rope, own, config.sliding_window if layer in config.sliding_layers else 0
    )


def make_ffn(config: ModelConfig, layer: int, own: Ownership, moe: bool | None = None) -> nn.Module:
    """``moe``: whether it is MoE (None: as the config says of ``layer``)."""
    if config.is_moe_layer(layer) if moe is None else moe:
        from seamline.model.moe import MoE
        from seamline.model.moe_oss import OssMoE

        return OssMoE(config, own) if config.family == "gpt_oss" else MoE(config, own)
    rows = own.shard_rows(config.intermediate_size)
    return GatedMLP(config.hidden_size, rows[1] - rows[0], config.hidden_act)


def _normed(x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
    return x if norm is None else norm(x)


class Block(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        own: Ownership,
        rope: RotaryTable,
        comm: Comm,
        moe: bool | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.comm = comm
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = make_attention(config, rope, own, layer)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # before the feed-forward
        self.ffn = make_ffn(config, layer, own, moe)
        # Gemma 3: norms of the attention's and the feed-forward's outputs (after the gates' sums)
        sandwich = config.sandwich_norms
        self.attn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.ffn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None

    def forward(self, x: torch.Tensor, spans: Sequence[Span], step: int = 0) -> torch.Tensor:
        partial = self.attn(self.input_norm(x), spans, self.layer)  # [N, hidden], this rank's heads
        x, normed = self.post_norm.add_forward(
            x, _normed(self._gate(partial, 0, step), self.attn_out_norm)
        )
        partial = self.ffn(normed)  # [N, hidden], this rank's rows / experts
        return x + _normed(self._gate(partial, 1, step), self.ffn_out_norm)

    def _gate(self, partial: torch.Tensor, gate: int, step: int) -> torch.Tensor:
        if self.comm.world == 1:  # the whole layer is here: nothing to sum, no tag to build
            return partial
        return self.comm.all_reduce(partial, GateTag(self.layer, gate, step))


class Stage(nn.Module):
    forks_caches = True  # a cache may start from a copy of another's first positions (prefixes)
    passes_ids = False  # the layers after the first need the tokens' ids beside the hidden state
    verifies_drafts = (
        True  # a window's rejected positions need no undoing: caches are written by position
    )

    def __init__(
        self, config: ModelConfig, own: Ownership, comm: Comm | None = None, mtp: bool = False
    ) -> None:
        """``mtp``: with the model's multi-token-prediction layer, which drafts (``model/mtp.py``;
        a stage that owns the whole head, alone in its group)."""
        super().__init__()
        own.validate(config)
        self.config = config
        self.ownership = own
        self.comm: Comm = comm if comm is not None else SingleComm()
        self.step = 0  # forwards so far: the third part of every gate's tag
        self.boundary_shape: tuple[int, ...] = (config.hidden_size,)  # a token's row between stages
        rope = make_rope(config)
        local = make_rope(config, local=True) if config.local_rope_theta else rope
        self.embed: Weight | None = (
            empty_param(config.vocab_size, config.hidden_size) if own.owns_embedding() else None
        )
        self.layers = nn.ModuleDict(
            {
                str(i): Block(
                    config, i, own, local if i in config.sliding_layers else rope, self.comm
                )
                for i in own.layer_indices()
            }
        )
        self.norm: RMSNorm | None = None
        self.head: Weight | None = None
        if own.owns_head(config):
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            v0, v1 = own.vocab_range(config)
            tied = self._tied_head(v0, v1)
            self.head = tied if tied is not None else empty_param(v1 - v0, config.hidden_size)
        self.mtp: NextTokenLayer | None = None
        self.hidden: torch.Tensor | None = (
            None  # with ``mtp``: the last forward's rows after the norm
        )
        if mtp:
            from seamline.model.mtp import NextTokenLayer

            self.mtp = NextTokenLayer(config, rope, own)
        # the layers a sequence's cache holds: the owned ones and the drafting layer's
        self.cache_layers = [
            *own.layer_indices(),
            *([self.mtp.layer] if self.mtp is not None else []),
        ]

    @torch.inference_mode()
    def draft_states(
        self, states: torch.Tensor, next_ids: torch.Tensor, spans: Sequence[Span]
    ) -> torch.Tensor:
        """The drafting layer over rows of final ``states`` [N, hidden] and the tokens after
        them ``next_ids`` [N], at the spans' positions: its output [N, hidden]."""
        assert self.mtp is not None
        table = self.embed if self.embed is not None else self.mtp.embed
        assert table is not None
        return self.mtp(states, embedding(next_ids, table, self.compute_dtype), spans)

    @torch.inference_mode()
    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """The logits [rows, vocab] of drafting-layer outputs [rows, hidden]: the token after next."""
        assert self.mtp is not None and self.head is not None
        return linear(self.mtp.norm(outputs), self.head)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = embedding(ids, self.embed, self.compute_dtype)  # type: ignore[arg-type]
        if (
            self.config.embed_scale != 1.0
        ):  # Gemma: the scale rounded to the dtype, as transformers does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def _tied_head(self, v0: int, v1: int) -> Weight | None:
        full = (v0, v1) == (0, self.config.vocab_size)
        return self.embed if self.config.tie_word_embeddings and full else None

    @property
    def input_device(self) -> torch.device:
        """Where a step's input goes: the embedding's device, else the first layer's."""
        if self.embed is not None:
            return self.embed.device
        block = next(iter(self.layers.values()))
        assert isinstance(block, Block)
        return block.input_norm.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the residual stream (routers may be kept in float32)."""
        block = next(iter(self.layers.values()))
        assert isinstance(block, Block)
        return block.input_norm.weight.dtype

    def new_cache(self, greedy: bool = False) -> SequenceCache:
        """``greedy``: unused here; a lockstep group then exchanges only (max, argmax)."""
        return SequenceCache(self.cache_layers, rings=self.rings, window=self.config.sliding_window)

    @property
    def rings(self) -> dict[int, int]:
        """The owned sliding layers' ring sizes (``model/cache.py``)."""
        ring = ring_size(self.config.sliding_window)
        return {i: ring for i in self.cache_layers if i in self.config.sliding_layers and ring}

    def release_cache(self, cache: SequenceCache) -> None:
        """A finished sequence's cache: garbage here (a lockstep group tells its ranks)."""

    def cache_bytes(self, tokens: int) -> int:
        """The KV bytes one sequence of ``tokens`` holds in this stage's layers (whole heads; a
        sliding layer at most its ring's)."""
        rings = self.rings
        positions = sum(min(tokens, rings[i]) if i in rings else tokens for i in self.cache_layers)
        return positions * kv_bytes_per_token(self.config, self.compute_dtype.itemsize)

    def forward(
        self, inputs: torch.Tensor, start: int, cache: SequenceCache, last_only: bool = False
    ) -> torch.Tensor:
        """inputs: ids [T] or hidden [T, hidden]; start: position of inputs[0]."""
        return self.forward_batch(inputs, [Span(0, inputs.shape[0], start, cache)], last_only)

    @torch.inference_mode()
    def forward_batch(
        self,
        inputs: torch.Tensor,
        spans: Sequence[Span],
        last_only: bool = False,
        logit_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """inputs: ids [N] or hidden [N, hidden], the rows of ``spans``. Returns the residual
        stream [N, hidden], or logits: [N, vocab_owned], or with ``last_only`` one row per
        span (its last), [len(spans), vocab_owned], or those of ``logit_rows`` (a speculative
        window's every row beside other spans' last)."""
        x = from_host(
            inputs, self.input_device
        )  # the step's one crossing in (``seamline.model.devices``)
        x = self._embed(x) if self.embed is not None else x
        step, self.step = self.step, self.step + 1
        for block in self.layers.values():
            if x.device != block.input_norm.weight.device:  # a node spanning its GPU and its CPU
                x = x.to(block.input_norm.weight.device)
            x = block(x, spans, step)
        for span in spans:
            span.cache.wrote(span.start + span.count)
        if self.head is None or self.norm is None:
            return x
        if x.device != self.norm.weight.device:
            x = x.to(self.norm.weight.device)
        if self.mtp is not None:  # the drafting layer reads every row's final state
            self.hidden = self.norm(x)
            rows = (
                logit_rows
                if logit_rows is not None
                else [s.end - 1 for s in spans]
                if last_only
                else None
            )
            return linear(self.hidden if rows is None else self.hidden[list(rows)], self.head)
        if logit_rows is not None:
            x = x[list(logit_rows)]
        elif last_only:
            x = x[-1:] if len(spans) == 1 else x[[s.end - 1 for s in spans]]
        return linear(self.norm(x), self.head)  # [rows, vocab_owned]
