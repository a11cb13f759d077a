"""Random valid GGUF blocks, and a timing table of quant_linear against float F.linear.

``python -m seamline.quant.bench_kernels`` prints ms per call for each quant type and shape.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from seamline.quant.matmul import quant_linear
from seamline.quant.tensor import QuantTensor

KERNEL_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
HALF_FIELDS = {  # byte offsets of each block's fp16 scale / min fields
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}
SHAPES = ((1, 576, 576), (1, 1536, 576), (1, 8192, 2048), (1, 49152, 576), (512, 2048, 2048))  # (M, rows, cols)


def random_weight(qtype: T, shape: tuple[int, ...], gen: torch.Generator | None = None) -> QuantTensor:
    """Random bytes with every fp16 field finite: scales in [0.001, 0.03), and the mins of Q4_1 /
    Q5_1 near -scale * (largest quant / 2), so that weights centre on zero as trained ones do."""
    block, size = GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    n_blocks = math.prod(lead) * cols // block
    raw = torch.randint(0, 256, (n_blocks, size), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n_blocks, generator=gen) * 0.029 + 0.001
    halves = [scale]
    if len(HALF_FIELDS[qtype]) == 2:
        spread = torch.rand(n_blocks, generator=gen) * 0.4 + 0.8
        top = {T.Q4_1: 15, T.Q5_1: 31}.get(qtype, 0)  # K-quant mins multiply 6-bit codes: left random
        halves.append(-scale * top / 2 * spread if top else scale * spread)
    for off, half in zip(HALF_FIELDS[qtype], halves):
        raw[:, off : off + 2] = half.to(torch.float16).view(torch.uint8).reshape(n_blocks, 2)
    return QuantTensor(qtype, raw.reshape(*lead, cols // block * size), shape)


def time_ms(fn: Callable[[], object], min_s: float = 0.2) -> float:
    """Median ms per call over a few batches of calls."""
    fn()
    n, spent = 1, 0.0
    while spent < 0.02:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        spent = time.perf_counter() - start
        n *= 2
    reps = max(1, int(n * min_s / max(spent, 1e-9) / 5))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - start) / reps * 1e3)
    return sorted(samples)[2]


def bench(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> list[dict[str, object]]:
    """One row per (shape, activation dtype): ms of quant_linear per type and of float F.linear."""
    table = []
    for m, rows, cols in SHAPES:
        for dt in dtypes:
            x = torch.randn(m, cols, dtype=dt)
            row: dict[str, object] = {"shape": f"[{m},{cols}]x[{rows},{cols}]^T", "act": str(dt).split(".")[-1]}
            for fdt in (torch.float32, torch.bfloat16):
                dense = torch.randn(rows, cols, dtype=fdt)
                row[f"F.linear {str(fdt).split('.')[-1]}"] = time_ms(lambda: F.linear(x.to(fdt), dense))
            for qt in KERNEL_TYPES:
                if cols % GGML_QUANT_SIZES[qt][0]:
                    continue  # a K-quant row must be whole 256-wide super-blocks
                w = random_weight(qt, (rows, cols))
                row[qt.name] = time_ms(lambda: quant_linear(x, w))
            table.append(row)
    return table


def main() -> None:
    for row in bench():
        cells = [f"{k}={v:.3f}" if isinstance(v, float) else f"{v}" for k, v in row.items()]
        print("  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
