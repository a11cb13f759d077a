"""The torch path's quantized matmul (``quant.matmul._tiled``) dequantises small row tiles.

Its decoders compute in float32 whatever the activations' dtype, and their temporaries stay in
the process's heap once freed (glibc keeps them when its mmap threshold has risen), so a tile
is bounded in float32 bytes: bfloat16 activations once made 8 MB temporaries per tile, which
held the embedded model at 1.4x its GGUF bytes (``seamline bench quant``'s memory ratio).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from seamline.quant import matmul
from seamline.quant.bench_kernels import random_weight
from seamline.quant.dequant import dequantize
from seamline.quant.tensor import QuantTensor


@pytest.fixture
def tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """The shape of every weight ``_tiled`` dequantises."""
    seen: list[tuple[int, ...]] = []
    real = matmul.dequantize

    def spy(w: QuantTensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(w.shape)
        return real(w, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(matmul, "dequantize", spy)
    yield seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_torch_path_tiles_are_bounded_in_float32_bytes(
    tiles: list, dtype: torch.dtype, qtype: T
) -> None:
    cols = 512
    rows = 3 * matmul.TILE_BYTES // (cols * 4) + 5  # three whole tiles and a part
    w = random_weight(qtype, (rows, cols), torch.Generator().manual_seed(1))
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = matmul.quant_linear(x, w, use_kernels=False)
    assert len(tiles) == 4 and all(r * c * 4 <= matmul.TILE_BYTES for r, c in tiles), tiles
    assert sum(r for r, _ in tiles) == rows and got.shape == (3, rows) and got.dtype == dtype
    want = F.linear(x.float(), dequantize(w, use_kernels=False).to(dtype).float())
    assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()
