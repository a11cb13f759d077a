"""DeepSeek-V3's multi-token-prediction (MTP) layer: a draft of the token after the next.

The checkpoint's layer ``num_hidden_layers`` (``model.layers.{N}.*``) predicts token t+2 from
the final state of position t (after the model's norm) and the token t+1 drawn after it, by the
published formula, embedding first:

    h' = eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])
    o  = Block_N(h') at position t, over its own attention cache (layer N of the sequence's cache)
    logits = head(norm_N(o))          (``shared_head.norm``; the model's own head)

Chained for a longer draft, ``o`` stands where ``h`` stood, at the next position. On a stage
without the model's embedding (a pipeline's last stage) the layer reads its own copy, which
DeepSeek's checkpoints store with it (``embed_tokens``). The layer
only proposes: a draft's token is kept only where the model's own draw agrees, so its cache
may lag or hold a chained draft's state at some position without changing any output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from seamline.config import ModelConfig
from seamline.model.cache import Span
from seamline.model.layers import RMSNorm, empty_param
from seamline.model.linear import linear
from seamline.model.rope import RotaryTable
from seamline.ownership import Ownership
from seamline.parallel.comm import SingleComm


class NextTokenLayer(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryTable, own: Ownership) -> None:
        from seamline.model.stage import Block

        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer = config.num_layers  # its index in the checkpoint and in a sequence's cache
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = empty_param(hidden, 2 * hidden)
        self.embed = (
            None if own.owns_embedding() else empty_param(config.vocab_size, hidden)
        )  # the layer's own
        self.block = Block(config, self.layer, own, rope, SingleComm(), moe=config.mtp_moe)
        self.norm = RMSNorm(hidden, eps)

    def forward(
        self, states: torch.Tensor, embedded: torch.Tensor, spans: Sequence[Span]
    ) -> torch.Tensor:
        """states: [N, hidden], the model's final states (or a chained draft's output) at the
        spans' positions; embedded: [N, hidden], the next tokens' embeddings. Returns the
        block's output [N, hidden] (before ``norm``)."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(states)], dim=-1)
        return self.block(linear(joined, self.eh_proj), spans)
