"""Random valid GGUF blocks, and timings of quant_linear against float F.linear.

``python -m seamline.quant.bench_kernels`` prints ms per call for each quant type and shape,
then the ms of all the weight matmuls of one decode token of two model shapes (random weights).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from seamline.quant.matmul import quant_linear
from seamline.quant.tensor import QUANT_TYPES, SCALE_OFFSETS, QuantTensor

KERNEL_TYPES = tuple(sorted(QUANT_TYPES))  # by GGML type id: Q4_0 .. Q6_K
SHAPES = (
    (1, 576, 576),
    (1, 1536, 576),
    (1, 8192, 2048),
    (1, 49152, 576),
    (512, 2048, 2048),
)  # (M, rows, cols)
# the weight matmuls of one decode token: (type, (rows, cols), count)
MODELS: dict[str, tuple[tuple[T, tuple[int, int], int], ...]] = {
    "SmolLM2-135M Q4_1, Q8_0 head": (
        (T.Q4_1, (576, 576), 60),
        (T.Q4_1, (192, 576), 60),
        (T.Q4_1, (1536, 576), 60),
        (T.Q4_1, (576, 1536), 30),
        (T.Q8_0, (49152, 576), 1),
    ),
    "Llama-3.2-1B Q4_K_M": (  # Q6_K for attn_v / ffn_down in 7 of 16 layers and the head
        (T.Q4_K, (2048, 2048), 32),
        (T.Q4_K, (512, 2048), 25),
        (T.Q6_K, (512, 2048), 7),
        (T.Q4_K, (8192, 2048), 32),
        (T.Q4_K, (2048, 8192), 9),
        (T.Q6_K, (2048, 8192), 7),
        (T.Q6_K, (128256, 2048), 1),
    ),
}


def random_weight(
    qtype: T, shape: tuple[int, ...], gen: torch.Generator | None = None
) -> QuantTensor:
    """Random bytes with every fp16 field finite: scales in [0.001, 0.03), and the mins of Q4_1 /
    Q5_1 near -scale * (largest quant / 2), so that weights centre on zero as trained ones do."""
    block, size = GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    n_blocks = math.prod(lead) * cols // block
    raw = torch.randint(0, 256, (n_blocks, size), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n_blocks, generator=gen) * 0.029 + 0.001
    halves = [scale]
    if len(SCALE_OFFSETS[qtype]) == 2:
        spread = torch.rand(n_blocks, generator=gen) * 0.4 + 0.8
        top = {T.Q4_1: 15, T.Q5_1: 31}.get(
            qtype, 0
        )  # K-quant mins multiply 6-bit codes: left random
        halves.append(-scale * top / 2 * spread if top else scale * spread)
    for off, half in zip(SCALE_OFFSETS[qtype], halves):
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


def bench(
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
) -> list[dict[str, object]]:
    """One row per (shape, activation dtype): ms of quant_linear per type and of float F.linear."""
    table = []
    for m, rows, cols in SHAPES:
        for dt in dtypes:
            x = torch.randn(m, cols, dtype=dt)
            row: dict[str, object] = {
                "shape": f"[{m},{cols}]x[{rows},{cols}]^T",
                "act": str(dt).split(".")[-1],
            }
            for fdt in (torch.float32, torch.bfloat16):
                dense = torch.randn(rows, cols, dtype=fdt)
                row[f"F.linear {str(fdt).split('.')[-1]}"] = time_ms(
                    lambda: F.linear(x.to(fdt), dense)  # noqa: B023 (called at once)
                )
            for qt in KERNEL_TYPES:
                if cols % GGML_QUANT_SIZES[qt][0]:
                    continue  # a K-quant row must be whole 256-wide super-blocks
                w = random_weight(qt, (rows, cols))
                row[qt.name] = time_ms(lambda: quant_linear(x, w))  # noqa: B023 (called at once)
            table.append(row)
    return table


def model_token_ms(name: str, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """Best wall ms of one pass over all the weight matmuls of MODELS[name], one activation row."""
    gen = torch.Generator().manual_seed(0)
    weights = [
        random_weight(qt, shape, gen) for qt, shape, count in MODELS[name] for _ in range(count)
    ]
    xs = {w.shape[1]: torch.randn(1, w.shape[1], generator=gen).to(dtype) for w in weights}
    best = math.inf
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for w in weights:
            quant_linear(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    print(f"{torch.get_num_threads()} threads; ms per call", flush=True)
    for row in bench():
        cells = [f"{k}={v:.3f}" if isinstance(v, float) else f"{v}" for k, v in row.items()]
        print("  ".join(cells), flush=True)
    for name in MODELS:
        for dt in (torch.float32, torch.bfloat16):
            print(
                f"{name}, {dt}: {model_token_ms(name, dt):.2f} ms of matmuls per token", flush=True
            )


if __name__ == "__main__":
    main()
