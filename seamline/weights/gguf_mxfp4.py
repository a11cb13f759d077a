"""GGUF's MXFP4 blocks (llama.cpp's type 39, gpt-oss's experts) as fp4 ``ScaledTensor`` weights
of the same size: a block is one UE8M0 byte e and 16 bytes whose low nibbles are the block's
first 16 e2m1 codes and whose high nibbles the last 16, each weight ``e2m1(code) * 2 ** (e -
127)``; the fp4 weights pack each row's codes two a byte in order (low nibble first), one scale
per 32."""

from __future__ import annotations

import numpy as np
import torch

from seamline.quant.scaled import ScaledTensor, scale_values

BLOCK_BYTES = 17  # 1 scale byte, 16 bytes of codes


def mxfp4_blocks(raw: np.ndarray) -> ScaledTensor:
    """raw [rows, row bytes] of MXFP4 blocks -> the fp4 weight [rows, 32 x blocks]."""
    blocks = raw.reshape(raw.shape[0], -1, BLOCK_BYTES)
    scales, codes = blocks[..., 0], blocks[..., 1:]
    ordered = np.concatenate(
        [codes & 0x0F, codes >> 4], axis=-1
    )  # [rows, blocks, 32] codes in order
    packed = (ordered[..., 0::2] | (ordered[..., 1::2] << 4)).astype(np.uint8)
    values = torch.from_numpy(np.ascontiguousarray(packed.reshape(raw.shape[0], -1)))
    return ScaledTensor("fp4", values, scale_values(torch.from_numpy(np.ascontiguousarray(scales))))
