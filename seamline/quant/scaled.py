"""ScaledTensor: a weight kept as DeepSeek's checkpoints store it, low-bit values with scales.

Two kinds, as a DeepSeek-V4 checkpoint declares them (``quantization_config``: ``fp8``,
``expert_dtype: fp4``):

- ``fp8``: float8 e4m3 values ``[*lead, rows, cols]`` and one scale per block of the grid
  ``[*lead, rows / bm, cols / bn]`` (128 x 128 in V4);
- ``fp4``: e2m1 values packed two a byte (low nibble first) ``[*lead, rows, cols / 2]`` and
  one scale per ``bn`` (32) consecutive weights of a row, ``[*lead, rows, cols / bn]``.

Scales are float32 here, whatever the file held (UE8M0 powers of two or floats). A weight is
``values * scale`` of its block. It stays this size in memory; ``dequantize`` makes the float
form for one multiplication (``model/linear.py``) and lets it go.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seamline.errors import CheckpointError

# e2m1: sign, 2 exponent bits, 1 mantissa bit (nibble values 0..15)
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
KIND_NAMES = {
    "fp8": "float8_e4m3",
    "fp4": "float4_e2m1",
}  # stored type names (fragments, the planner)


class ScaledTensor:
    __slots__ = ("kind", "values", "scales", "shape")

    def __init__(
        self,
        kind: str,
        values: torch.Tensor,
        scales: torch.Tensor,
        shape: Sequence[int] | None = None,
    ) -> None:
        self.kind, self.values, self.scales = kind, values, scales.float()
        if kind == "fp8":
            if values.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"fp8 weights must be float8_e4m3fn, not {values.dtype}")
            self.shape = tuple(values.shape)
        elif kind == "fp4":
            if values.dtype not in (torch.int8, torch.uint8):
                raise CheckpointError(
                    f"fp4 weights must be packed in int8 bytes, not {values.dtype}"
                )
            self.shape = (*values.shape[:-1], 2 * values.shape[-1])
        else:
            raise CheckpointError(f"unknown scaled weight kind {kind!r}")
        if shape is not None and tuple(shape) != self.shape:
            raise CheckpointError(
                f"{kind} values {tuple(values.shape)} do not hold a {tuple(shape)} weight"
            )
        self._check_grid()

    def _check_grid(self) -> None:
        grid = tuple(self.scales.shape)
        if (
            len(grid) != len(self.shape)
            or grid[:-2] != self.shape[:-2]
            or any(s == 0 or n % s for n, s in zip(self.shape[-2:], grid[-2:]))
        ):
            raise CheckpointError(
                f"{self.kind} scale grid {grid} does not divide a {self.shape} weight"
            )
        if self.kind == "fp4" and grid[-2] != self.shape[-2]:
            raise CheckpointError(
                f"fp4 scales {grid} are not one row of scales per weight row {self.shape}"
            )

    @property
    def block(self) -> tuple[int, int]:
        """(rows, cols) of weights one scale covers."""
        return self.shape[-2] // self.scales.shape[-2], self.shape[-1] // self.scales.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scales.numel() * 4

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def stored_type(self) -> str:
        return KIND_NAMES[self.kind]

    def dim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kind == "fp8":
            values = self.values.float()
        else:
            packed = self.values.view(torch.uint8).long()
            grid = E2M1.to(packed.device)
            values = torch.stack((grid[packed & 0xF], grid[packed >> 4]), dim=-1).flatten(-2)
        bm, bn = self.block
        scales = self.scales.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)
        return (values * scales).to(dtype)

    def select(self, index: int) -> ScaledTensor:
        return ScaledTensor(self.kind, self.values[index], self.scales[index])

    def row_slice(self, start: int, end: int) -> ScaledTensor:
        bm = self.block[0]
        if start % bm or end % bm:
            raise ValueError(f"rows [{start},{end}) cut {self.kind} blocks of {bm} rows")
        return ScaledTensor(
            self.kind, self.values[..., start:end, :], self.scales[..., start // bm : end // bm, :]
        )

    def column_aligned(self, start: int, end: int) -> bool:
        bn = self.block[1]
        return start % bn == 0 and end % bn == 0

    def column_slice(self, start: int, end: int) -> ScaledTensor:
        if not self.column_aligned(start, end):
            raise ValueError(
                f"columns [{start},{end}) cut {self.kind} blocks of {self.block[1]} columns"
            )
        per_byte = 2 if self.kind == "fp4" else 1
        bn = self.block[1]
        values = self.values[..., start // per_byte : end // per_byte].contiguous()
        return ScaledTensor(
            self.kind, values, self.scales[..., start // bn : end // bn].contiguous()
        )

    def first_bad_block(self) -> int | None:
        """The first block whose scale is infinite, NaN or negative, or None."""
        bad = ~torch.isfinite(self.scales) | (self.scales < 0)
        return int(bad.reshape(-1).nonzero()[0]) if bool(bad.any()) else None

    def contiguous(self) -> ScaledTensor:
        return ScaledTensor(self.kind, self.values.contiguous(), self.scales.contiguous())

    def to(self, device: torch.device | str) -> ScaledTensor:
        return ScaledTensor(self.kind, self.values.to(device), self.scales.to(device))

    def __repr__(self) -> str:
        return f"ScaledTensor({self.kind}, shape={self.shape}, block={self.block}, bytes={self.nbytes})"


def concat_scaled_rows(parts: Sequence[ScaledTensor]) -> ScaledTensor:
    """Parts of one kind, width and block, one after the other along the rows."""
    first = parts[0]
    if any(
        p.kind != first.kind or p.block != first.block or p.shape[-1] != first.shape[-1]
        for p in parts
    ):
        raise ValueError("concat_scaled_rows needs parts of one kind, block and width")
    return ScaledTensor(
        first.kind,
        torch.cat([p.values for p in parts], dim=-2),
        torch.cat([p.scales for p in parts], dim=-2),
    )


def stack_scaled(parts: Sequence[ScaledTensor]) -> ScaledTensor:
    """Parts of one kind and shape on a new leading dim (experts)."""
    first = parts[0]
    if any(p.kind != first.kind or p.shape != first.shape or p.block != first.block for p in parts):
        raise ValueError("stack_scaled needs parts of one kind, shape and block")
    return ScaledTensor(
        first.kind, torch.stack([p.values for p in parts]), torch.stack([p.scales for p in parts])
    )


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's scales as float32: UE8M0 bytes are powers of two, 2 ** (byte - 127); the
    byte 0xFF is NaN, no power of two (a CheckpointError, where the caller names the tensor)."""
    if scales.dtype == torch.uint8:
        if bool((scales == 0xFF).any()):
            bad = int((scales.reshape(-1) == 0xFF).nonzero()[0])
            raise CheckpointError(
                f"block scale {bad} is the UE8M0 byte 0xFF (NaN): not a power of two"
            )
        return (scales.float() - 127.0).exp2()
    return scales.float()
