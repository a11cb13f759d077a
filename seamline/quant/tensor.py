"""QuantTensor: a weight kept in GGUF's block layout, and RowConcat: rows of mixed types.

A QuantTensor holds the GGUF bytes of a weight whose logical shape is ``[*lead, rows, cols]``
(``lead``: a stack of experts, or nothing) as uint8 ``data [*lead, rows, row_bytes]``. Every
row is whole blocks, so selecting experts or slicing rows are zero-copy views; a column
slice must fall on block boundaries (``column_slice``), else the caller dequantises.

A RowConcat is a fused projection (q/k/v, gate/up) whose parts have different quant types
(a Q4_K_M file keeps ``attn_v`` in Q6_K): its output is the parts' outputs side by side.
Fusion into one QuantTensor happens only across parts of one type (``concat_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from seamline.errors import CheckpointError
from seamline.quant.sizes import QUANT_TYPE_NAMES, row_bytes

# kept quantized in memory; other GGUF types load as float
QUANT_TYPES = frozenset(GGMLQuantizationType[name] for name in QUANT_TYPE_NAMES)
K_TYPES = frozenset(
    GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K")
)  # 256-wide super-blocks
# Byte offsets of each type's float16 scale fields within a block (d, and m / dmin).
SCALE_OFFSETS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    GGMLQuantizationType[name]: offsets
    for name, offsets in (
        ("Q4_0", (0,)),
        ("Q4_1", (0, 2)),
        ("Q5_0", (0,)),
        ("Q5_1", (0, 2)),
        ("Q8_0", (0,)),
        ("Q4_K", (0, 2)),
        ("Q5_K", (0, 2)),
        ("Q6_K", (208,)),
    )
}


class QuantTensor:
    """GGUF blocks plus the logical shape they encode (see the module docstring)."""

    __slots__ = ("qtype", "data", "shape")

    def __init__(
        self, qtype: GGMLQuantizationType, data: torch.Tensor, shape: Sequence[int]
    ) -> None:
        self.qtype = GGMLQuantizationType(qtype)
        self.data = data
        self.shape = tuple(int(s) for s in shape)
        block = self.block_size
        want = (*self.shape[:-1], row_bytes(self.qtype, self.shape[-1]))
        if data.dtype != torch.uint8 or self.shape[-1] % block or tuple(data.shape) != want:
            raise CheckpointError(
                f"{self.qtype.name} blocks {tuple(data.shape)} {data.dtype} do not encode a "
                f"{self.shape} weight (want uint8 {want}, rows of whole {block}-wide blocks)"
            )

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return len(self.shape)

    def select(self, index: int) -> QuantTensor:
        """One entry of the leading (expert) dimension."""
        return QuantTensor(self.qtype, self.data[index], self.shape[1:])

    def row_slice(self, start: int, end: int) -> QuantTensor:
        """Rows [start, end) of the output dimension (dim -2)."""
        return QuantTensor(
            self.qtype,
            self.data[..., start:end, :],
            (*self.shape[:-2], end - start, self.shape[-1]),
        )

    def column_aligned(self, start: int, end: int) -> bool:
        return start % self.block_size == 0 and end % self.block_size == 0

    def column_slice(self, start: int, end: int) -> QuantTensor:
        """Columns [start, end) (input features), on block boundaries: a contiguous copy."""
        if not self.column_aligned(start, end):
            raise ValueError(
                f"columns [{start},{end}) cut {self.qtype.name} blocks of {self.block_size}"
            )
        size = GGML_QUANT_SIZES[self.qtype][1]
        first, last = start // self.block_size * size, end // self.block_size * size
        return QuantTensor(
            self.qtype, self.data[..., first:last].contiguous(), (*self.shape[:-1], end - start)
        )

    def first_bad_block(self) -> int | None:
        """The index of the first block whose float16 scales are inf or NaN, or None."""
        size = GGML_QUANT_SIZES[self.qtype][1]
        blocks = self.data.reshape(-1, size)
        for at in SCALE_OFFSETS[self.qtype]:
            half = blocks[:, at : at + 2].contiguous().view(torch.int16).reshape(-1)
            bad = (half & 0x7C00) == 0x7C00  # all exponent bits set: inf or NaN
            if bool(bad.any()):
                return int(bad.nonzero()[0])
        return None

    def contiguous(self) -> QuantTensor:
        return QuantTensor(self.qtype, self.data.contiguous(), self.shape)

    def to(self, device: torch.device | str) -> QuantTensor:
        return QuantTensor(self.qtype, self.data.to(device), self.shape)

    def __repr__(self) -> str:
        return f"QuantTensor({self.qtype.name}, shape={self.shape}, bytes={self.nbytes})"


def concat_rows(parts: Sequence[QuantTensor]) -> QuantTensor:
    """Parts of one quant type and width, concatenated along the rows (dim -2)."""
    first = parts[0]
    if any(
        p.qtype != first.qtype or p.shape[:-2] != first.shape[:-2] or p.shape[-1] != first.shape[-1]
        for p in parts
    ):
        raise ValueError("concat_rows needs parts of one quant type, lead shape and width")
    data = torch.cat([p.data for p in parts], dim=-2)
    rows = sum(p.shape[-2] for p in parts)
    return QuantTensor(first.qtype, data, (*first.shape[:-2], rows, first.shape[-1]))


def stack(parts: Sequence[QuantTensor]) -> QuantTensor:
    """Parts of one quant type and shape stacked on a new leading dim (experts)."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.shape != first.shape for p in parts):
        raise ValueError("stack needs parts of one quant type and shape")
    return QuantTensor(
        first.qtype, torch.stack([p.data for p in parts]), (len(parts), *first.shape)
    )
