"""A layer's small steps as single Triton kernels on a GPU: the CUDA forms of ``model/fused.py``'s
C++ ops (``rms_norm``, ``add_rms_norm``, ``silu_mul``; the decode attention ops in
``model/gpu_attention.py``), with the same signatures and answers
(float32 inside, rounded once to the activations' dtype). At one token a GPU step is bound by
how many kernels it launches, not by their arithmetic: eager torch takes 3-6 kernels for each
of these. Triton is imported here only, on first use; without it ``ops()`` is empty and the
eager forms run. Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (the tests)."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

FLOAT_DTYPES = frozenset(
    (torch.float32, torch.bfloat16, torch.float16)
)  # what the kernels take, as the C++ ops


@lru_cache(maxsize=1)
def ops() -> dict[str, Callable[..., Any]]:
    """name -> the Triton form of that fused op (empty without Triton)."""
    try:
        from seamline.model import gpu_attention, gpu_kernels
    except ImportError:
        return {}
    return {
        "rms_norm": gpu_kernels.rms_norm,
        "add_rms_norm": gpu_kernels.add_rms_norm,
        "silu_mul": gpu_kernels.silu_mul,
        "decode_attention": gpu_attention.decode_attention,
        "decode_attention_batch": gpu_attention.decode_attention_batch,
    }


def op_for(x: torch.Tensor, name: str) -> Callable[..., Any] | None:
    """The Triton op ``name`` for a contiguous float CUDA tensor, else None."""
    if not (x.is_cuda and x.is_contiguous() and x.dtype in FLOAT_DTYPES):
        return None
    return ops().get(name)
