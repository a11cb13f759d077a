"""DeepSeek-V4's multi-token-prediction layer (``mtp.0.*`` in its checkpoints): a draft of the
token after the next, as DeepSeek's reference computes it.

From the residual streams of position t after the model's last layer (before its hyper-head)
and the token t+1 drawn after it:

    x  = e_proj(enorm(embed(t+1))) + h_proj(hnorm(h_t))     (the embedding's term on every stream)
    o  = Block(x) at position t: a sliding-window layer (no compression) with a routed MoE
    logits = head(norm(hc_head_mtp(o)))                      (its own hyper-head; the model's head)

Chained for a longer draft, ``o`` stands where ``h`` stood, at the next position. Its cache is
layer ``num_hidden_layers`` of the sequence's ``V4Cache``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from seamline.config import ModelConfig
from seamline.model.cache import Span
from seamline.model.hyper import HyperHead
from seamline.model.layers import RMSNorm, empty_param
from seamline.model.linear import linear
from seamline.model.v4_parts import weighted_rms
from seamline.ownership import Ownership
from seamline.parallel.comm import SingleComm

MTP_ATTENTION, MTP_FEED_FORWARD = (
    "sliding_attention",
    "moe",
)  # the reference's layer: compress ratio 0, a learned router


class V4NextTokenLayer(nn.Module):
    def __init__(self, config: ModelConfig, own: Ownership) -> None:
        from seamline.model.v4_stage import V4Block

        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer, self.eps = config.num_layers, eps  # its index in a sequence's cache
        self.enorm, self.hnorm, self.norm = (
            RMSNorm(hidden, eps),
            RMSNorm(hidden, eps),
            RMSNorm(hidden, eps),
        )
        self.e_proj = empty_param(hidden, hidden)
        self.h_proj = empty_param(hidden, hidden)
        self.hc_head = HyperHead(hidden, int(config.hf["hc_mult"]), config.hf["hc_eps"], eps)
        self.block = V4Block(
            config, self.layer, own, SingleComm(), kinds=(MTP_ATTENTION, MTP_FEED_FORWARD)
        )
        self.embed = (
            None if own.owns_embedding() else empty_param(config.vocab_size, hidden)
        )  # the model's, copied

    def forward(
        self, states: torch.Tensor, embedded: torch.Tensor, ids: torch.Tensor, spans: Sequence[Span]
    ) -> torch.Tensor:
        """states: [N, hc_mult, hidden], the model's last residual (or a chained draft's output)
        at the spans' positions; embedded: [N, hidden], the next tokens' (``ids``) embeddings.
        Returns the block's output [N, hc_mult, hidden]."""
        e = linear(weighted_rms(embedded, self.enorm.weight, self.eps), self.e_proj)
        h = linear(weighted_rms(states, self.hnorm.weight, self.eps), self.h_proj)
        return self.block(h + e.unsqueeze(1), ids, spans, 0)

    def logits_input(self, outputs: torch.Tensor) -> torch.Tensor:
        """What the model's head multiplies: [N, hidden] from the block's outputs."""
        return weighted_rms(self.hc_head(outputs), self.norm.weight, self.eps)
