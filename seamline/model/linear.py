"""The linear seam: every weight matmul, embedding lookup and weight slice in the model.

A weight is a float tensor, a ``QuantTensor`` (GGUF blocks, multiplied by fused kernels), a
``ScaledTensor`` (DeepSeek's fp8 / fp4 values with block scales, dequantised per product), a
``RowConcat`` (a fused projection whose parts differ in quant type) or a ``ColumnWindow`` (a
lockstep rank's column share that cuts quant blocks). Model code calls
``linear``, ``embedding``, ``rows``, ``columns`` and ``select`` and never learns which kind
it holds. A float weight narrower than the activations (a bfloat16 checkpoint under
``--dtype float32``) is multiplied in its own dtype rather than widened in memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from seamline.quant.dequant import dequantize, dequantize_rows
from seamline.quant.matmul import quant_linear, same_arithmetic_rows
from seamline.quant.scaled import ScaledTensor
from seamline.quant.tensor import QuantTensor


class RowConcat:
    """Weights of equal width whose outputs are concatenated: ``[*lead, sum(rows), cols]``."""

    __slots__ = ("parts", "shape")

    def __init__(self, parts: Sequence[Weight]) -> None:
        self.parts = tuple(parts)
        first = tuple(self.parts[0].shape)
        self.shape = (*first[:-2], sum(p.shape[-2] for p in self.parts), first[-1])

    @property
    def nbytes(self) -> int:
        return sum(weight_bytes(p) for p in self.parts)

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"RowConcat({', '.join(map(repr, self.parts))})"


class ColumnWindow:
    """Columns [lead, lead + width) of ``cover``, the whole quant blocks around them: a lockstep
    rank's share of a weight split across its input columns, where the split cuts blocks. The
    columns outside the window meet zero inputs, so the product is exact; the cost is at most
    two extra blocks a row."""

    __slots__ = ("cover", "lead", "width", "shape")

    def __init__(self, cover: QuantTensor, lead: int, width: int) -> None:
        self.cover, self.lead, self.width = cover, lead, width
        self.shape = (*cover.shape[:-1], width)

    @classmethod
    def around(cls, w: QuantTensor, start: int, end: int) -> ColumnWindow:
        """The window of columns [start, end) of ``w``."""
        block = w.block_size
        first, last = start // block * block, -(-end // block) * block
        return cls(w.column_slice(first, last), start - first, end - start)

    @property
    def nbytes(self) -> int:
        return self.cover.nbytes

    def dim(self) -> int:
        return len(self.shape)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., width] placed in zeros [..., cover width]."""
        return F.pad(x, (self.lead, self.cover.shape[-1] - self.lead - self.width))

    def __repr__(self) -> str:
        return f"ColumnWindow({self.cover!r}, lead={self.lead}, width={self.width})"


Weight = torch.Tensor | QuantTensor | ScaledTensor | RowConcat | ColumnWindow


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., cols] @ w.T [+ bias] -> [..., rows] in x's dtype."""
    if isinstance(w, torch.Tensor):
        if w.dtype == x.dtype:
            return F.linear(x, w, bias)
        out = F.linear(x.to(w.dtype), w)  # a narrower float weight: multiply in its dtype
        return out.to(x.dtype) if bias is None else out.to(x.dtype) + bias
    if isinstance(w, QuantTensor):
        return quant_linear(x, w, bias)
    if isinstance(w, ScaledTensor):
        return F.linear(x, w.dequantize(x.dtype), bias)
    if isinstance(w, ColumnWindow):
        return quant_linear(w.padded(x), w.cover, bias)
    out = torch.cat([linear(x, part) for part in w.parts], dim=-1)
    return out if bias is None else out + bias


def rows_computed_alike() -> int:
    """The most rows a step may hold while each quantized matmul computes a row as it would
    alone (``quant.matmul.same_arithmetic_rows``). Float weights go to torch's GEMMs, whose
    sums may differ in the last bits by the number of rows (near ties, not more)."""
    return same_arithmetic_rows()


def embedding(ids: torch.Tensor, table: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the table in ``dtype``; a quantized table dequantises only those rows."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table).to(dtype)
    if isinstance(table, QuantTensor):
        return dequantize_rows(table, ids, dtype)
    raise TypeError("an embedding table is one tensor, not a concatenation")


def rows(w: Weight, start: int, end: int) -> Weight:
    """Output rows [start, end) (dim -2): views, no copies."""
    if isinstance(w, torch.Tensor):
        return w[..., start:end, :]
    if isinstance(w, (QuantTensor, ScaledTensor)):
        return w.row_slice(start, end)
    if isinstance(w, ColumnWindow):
        return ColumnWindow(w.cover.row_slice(start, end), w.lead, w.width)
    picked, offset = [], 0
    for part in w.parts:
        size = part.shape[-2]
        lo, hi = max(start - offset, 0), min(end - offset, size)
        if lo < hi:
            picked.append(rows(part, lo, hi))
        offset += size
    return picked[0] if len(picked) == 1 else RowConcat(picked)


def columns(w: Weight, start: int, end: int) -> Weight:
    """Input columns [start, end) (dim -1); a quantized weight only on its block boundaries
    (see ``granule``)."""
    if isinstance(w, torch.Tensor):
        return w[..., start:end]
    if isinstance(w, (QuantTensor, ScaledTensor)):
        return w.column_slice(start, end)
    if isinstance(w, ColumnWindow):
        raise ValueError("a column window is not sliced again")
    return RowConcat([columns(part, start, end) for part in w.parts])


def select(w: Weight, index: int) -> Weight:
    """Entry ``index`` of the leading (expert) dimension."""
    if isinstance(w, torch.Tensor):
        return w[index]
    if isinstance(w, (QuantTensor, ScaledTensor)):
        return w.select(index)
    if isinstance(w, ColumnWindow):
        return ColumnWindow(w.cover.select(index), w.lead, w.width)
    return RowConcat([select(part, index) for part in w.parts])


def granule(w: Weight) -> int:
    """The column step a slice of ``w`` must keep to: its largest quant block, or 1."""
    if isinstance(w, QuantTensor):
        return w.block_size
    if isinstance(w, ScaledTensor):
        return w.block[1]
    if isinstance(w, ColumnWindow):
        return w.cover.block_size
    if isinstance(w, RowConcat):
        return max(granule(part) for part in w.parts)
    return 1


def weight_bytes(w: Weight) -> int:
    """Resident bytes of a weight (quantized blocks or float elements)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.nbytes


def to_device(w: Weight, device: torch.device | str) -> Weight:
    if isinstance(w, RowConcat):
        return RowConcat([to_device(part, device) for part in w.parts])
    if isinstance(w, ColumnWindow):
        return ColumnWindow(w.cover.to(device), w.lead, w.width)
    return w.to(device)


def to_float(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as one float tensor (dequantised if need be)."""
    if isinstance(w, torch.Tensor):
        return w.to(dtype)
    if isinstance(w, QuantTensor):
        return dequantize(w, dtype)
    if isinstance(w, ScaledTensor):
        return w.dequantize(dtype)
    if isinstance(w, ColumnWindow):
        return dequantize(w.cover, dtype)[..., w.lead : w.lead + w.width]
    return torch.cat([to_float(part, dtype) for part in w.parts], dim=-2)


def leading_bytes(w: Weight, count: int) -> bytes:
    """The first ``count`` stored elements (or block bytes) of ``w``: a cheap fingerprint."""
    if isinstance(w, RowConcat):
        return leading_bytes(w.parts[0], count)
    if isinstance(w, ColumnWindow):
        return leading_bytes(w.cover, count)
    if isinstance(w, QuantTensor):
        return w.data.reshape(-1)[:count].cpu().numpy().tobytes()
    if isinstance(w, ScaledTensor):
        return w.values.reshape(-1)[:count].view(torch.uint8).cpu().numpy().tobytes()
    return w.detach().reshape(-1)[:count].float().cpu().numpy().tobytes()


def dequantize_weights(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Replace every quantized weight in ``module`` by its float ``dtype`` form (the
    dequantised path benchmarks compare against)."""
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, (QuantTensor, ScaledTensor, RowConcat, ColumnWindow)):
                setattr(sub, name, torch.nn.Parameter(to_float(value, dtype), requires_grad=False))
