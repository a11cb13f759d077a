"""gpt-oss's mixture of experts: a router with a bias whose top-k logits are softmaxed
(``moe.route``, scoring ``topk_softmax``), and experts with biases whose gate and up rows (read
apart: ``weights/oss_experts.py``) meet in a clamped SwiGLU:
``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``, as
transformers' ``GptOssExperts`` computes it. Routing, grouping and expert shares are ``MoE``'s."""

from __future__ import annotations

import torch

from seamline.config import ModelConfig
from seamline.model.layers import empty_param
from seamline.model.linear import linear, select
from seamline.model.moe import MoE
from seamline.ownership import Ownership


class OssMoE(MoE):
    def __init__(self, config: ModelConfig, own: Ownership) -> None:
        super().__init__(config, own)
        self.router_logit_bias = empty_param(config.num_experts)  # replicated, as the router
        self.experts_gate_up_bias = empty_param(self.owned, 2 * self.inter)
        self.experts_down_bias = empty_param(self.owned, config.hidden_size)
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def _expert(self, x: torch.Tensor, local: int) -> torch.Tensor:
        gate_up = linear(x, select(self.experts_gate_up, local), self.experts_gate_up_bias[local])
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return linear(
            (up + 1) * glu, select(self.experts_down, local), self.experts_down_bias[local]
        )
