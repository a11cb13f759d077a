"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual is ``streams`` copies.

Between blocks the residual is ``[tokens, streams, hidden]``. Before a block (attention or
feed-forward), a ``HyperConnection`` reads all streams (flattened, RMS-normed without a weight)
and projects them to three mixes: ``pre`` [streams] collapses the streams into the block's
input, ``post`` [streams] spreads the block's output back over the streams, and ``comb``
[streams, streams], made doubly stochastic by Sinkhorn-Knopp iterations, mixes the old
streams into the new ones:

    new[k] = post[k] * block(sum_j pre[j] * old[j]) + sum_j comb[j, k] * old[j]

After the last layer, a ``HyperHead`` collapses the streams once more (its own ``pre``) for
the final norm and the output head. The mixes are computed in float32, as the reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seamline.model.layers import empty_param


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    def __init__(
        self, hidden: int, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.streams, self.sinkhorn_iters, self.eps, self.norm_eps = (
            streams,
            sinkhorn_iters,
            eps,
            norm_eps,
        )
        mixes = (2 + streams) * streams  # pre, post, then comb's streams x streams
        self.fn = empty_param(mixes, streams * hidden)
        self.base = empty_param(mixes)
        self.scale = empty_param(3)

    def mixes(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the block's input [T, hidden], post [T, streams], comb [T, streams, streams]) for
        ``residual`` [T, streams, hidden]."""
        n = self.streams
        flat = _unweighted_rms(residual.flatten(1).float(), self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = self._sinkhorn(comb)
        collapsed = (pre.unsqueeze(-1) * residual).sum(dim=1).to(residual.dtype)
        return collapsed, post, comb

    def _sinkhorn(self, comb: torch.Tensor) -> torch.Tensor:
        """Columns, then rows and columns in turn: close to doubly stochastic."""
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return comb

    @staticmethod
    def spread(
        residual: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The new residual: the block's ``output`` [T, hidden] spread by ``post``, plus the old
        streams mixed by ``comb`` (summed over its first axis: comb is not symmetric)."""
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), residual
        )


class HyperHead(nn.Module):
    """The streams collapsed one last time, before the final norm."""

    def __init__(self, hidden: int, streams: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = empty_param(streams, streams * hidden)
        self.base = empty_param(streams)
        self.scale = empty_param(1)

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        flat = _unweighted_rms(residual.flatten(1).float(), self.norm_eps)
        pre = (
            torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float())
            + self.eps
        )
        return (pre.unsqueeze(-1) * residual).sum(dim=1).to(residual.dtype)


def widen(x: torch.Tensor, streams: int) -> torch.Tensor:
    """The embedding's output [T, hidden] as the first residual: one copy per stream."""
    return x.unsqueeze(1).expand(-1, streams, -1).contiguous()
