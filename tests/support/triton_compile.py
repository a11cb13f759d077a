"""Compile every Triton kernel of seamline for a Hopper GPU (sm_90) and print one line per kernel:
run as its own process, without ``TRITON_INTERPRET`` (under it ``triton.jit`` gives functions the
compiler cannot take). Triton's compiler and ptxas come with the triton wheel: no GPU needed."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "compiles for a GPU: run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from seamline.model import gpu_attention, gpu_kernels  # noqa: E402
from seamline.quant import gpu_matmul  # noqa: E402
from seamline.quant.bench_kernels import KERNEL_TYPES  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
BF16 = "*bf16"


def compiles(
    name: str, fn: object, signature: dict[str, str], constants: dict[str, object]
) -> None:
    signature = {**signature, **{key: "constexpr" for key in constants}}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants), target=HOPPER
    )
    assert compiled.asm["cubin"], name
    print(f"compiled {name}", flush=True)


def main() -> int:
    for qtype in KERNEL_TYPES:
        compiles(
            f"blocks_matmul {qtype.name}",
            gpu_matmul._blocks_matmul,
            {
                "x_ptr": BF16,
                "w_ptr": "*u8",
                "out_ptr": BF16,
                "bias_ptr": BF16,
                "M": "i32",
                "N": "i32",
                "K": "i32",
                "row_bytes": "i32",
            },
            {"QTYPE": int(qtype), "HAS_BIAS": True, "BM": 16, "BN": 16},
        )
        compiles(
            f"dequantize {qtype.name}",
            gpu_matmul._dequantize,
            {"w_ptr": "*u8", "out_ptr": BF16, "N": "i32", "K": "i32", "row_bytes": "i32"},
            {"QTYPE": int(qtype), "BN": 16},
        )
    compiles(
        "rms_norm",
        gpu_kernels._rms_norm_kernel,
        {"x_ptr": BF16, "w_ptr": BF16, "out_ptr": BF16, "cols": "i32", "eps": "fp32"},
        {"BLOCK": 1024},
    )
    compiles(
        "add_rms_norm",
        gpu_kernels._add_rms_norm_kernel,
        {
            "x_ptr": BF16,
            "d_ptr": BF16,
            "w_ptr": BF16,
            "sum_ptr": BF16,
            "out_ptr": BF16,
            "cols": "i32",
            "eps": "fp32",
        },
        {"BLOCK": 1024},
    )
    compiles(
        "silu_mul",
        gpu_kernels._silu_mul_kernel,
        {"gu_ptr": BF16, "out_ptr": BF16, "inter": "i32"},
        {"BLOCK": 1024},
    )
    compiles(
        "rope_write",
        gpu_attention._rope_write,
        {
            "qkv_ptr": BF16,
            "cos_ptr": BF16,
            "sin_ptr": BF16,
            "table_ptr": "*i64",
            "q_out_ptr": "*fp32",
            "rows": "i32",
        },
        {"H": 32, "HKV": 4, "D": 64},
    )
    compiles(
        "attend",
        gpu_attention._attend,
        {
            "q_ptr": "*fp32",
            "table_ptr": "*i64",
            "out_ptr": BF16,
            "rows": "i32",
            "window": "i32",
            "scale": "fp32",
        },
        {"H": 32, "HKV": 4, "D": 64, "BLOCK": 64},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
