"""DeepSeek latent attention in GGUF: ``attn_kv_b`` and its split form ``attn_k_b`` + ``attn_v_b``.

Hugging Face's ``kv_b_proj`` is ``[heads * (nope + v), kv_lora]``: per head, ``nope`` rows that
expand the latent into the key's non-rotary part, then ``v`` rows for the value. llama.cpp's
converter (for its absorbed attention) writes it as two tensors per layer::

    attn_k_b  [heads, kv_lora, nope]   the key rows of each head, transposed
    attn_v_b  [heads, v, kv_lora]      the value rows of each head

(torch order; GGUF's ``ne`` is reversed). A reader joins them back into one ``kv_b_proj``; the
halves may have different quantisation types and the joined tensor has a third layout, so
it is dequantised to float32 at load -- it is small (``heads * (nope + v) * kv_lora``), and
seamline's absorbed attention slices it per head anyway.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf.quants import dequantize

from seamline.errors import CheckpointError
from seamline.weights.gguf_file import GGUFFile, TensorInfo
from seamline.weights.gguf_names import JOINED_KEYS, block_key

KV_B = "model.layers.{layer}.self_attn.kv_b_proj.weight"


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """k_b [H, kv_lora, nope] + v_b [H, v, kv_lora] -> kv_b [H * (nope + v), kv_lora]."""
    heads, lora, _ = k_b.shape
    joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [H, nope + v, kv_lora]
    return np.ascontiguousarray(joined.reshape(-1, lora))


def split_kv_b(kv_b: np.ndarray, heads: int, nope: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``join_kv_b``: kv_b [H * (nope + v), kv_lora] -> (k_b, v_b)."""
    per_head = kv_b.reshape(heads, -1, kv_b.shape[-1])  # [H, nope + v, kv_lora]
    k_b = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
    return k_b, np.ascontiguousarray(per_head[:, nope:])


class JoinedEntry(NamedTuple):
    """kv_b_proj of one layer, read from its attn_k_b and attn_v_b halves."""

    k: TensorInfo
    v: TensorInfo
    shape: tuple[int, ...]  # HF shape [H * (nope + v), kv_lora]

    def read(self, f: GGUFFile) -> torch.Tensor:
        k_b, v_b = (_float(f, info) for info in (self.k, self.v))
        return torch.from_numpy(join_kv_b(k_b, v_b))


def _float(f: GGUFFile, info: TensorInfo) -> np.ndarray:
    qtype = info.qtype
    if qtype is None:
        raise CheckpointError(f"GGUF file {f.path}: tensor '{info.name}' has {info.type_name}")
    return np.asarray(dequantize(f.raw(info), qtype), dtype=np.float32).reshape(info.shape)


def joined_entries(f: GGUFFile) -> dict[str, JoinedEntry]:
    """Every layer's kv_b_proj that the file stores split; a half without its pair is refused."""
    halves: dict[str, dict[str, TensorInfo]] = {}
    for info in f.tensors.values():
        key = block_key(info.name)
        if key in JOINED_KEYS and info.name.endswith(".weight"):
            halves.setdefault(info.name.split(".")[1], {})[JOINED_KEYS[key]] = info
    out: dict[str, JoinedEntry] = {}
    for layer, pair in halves.items():
        if set(pair) != {"k", "v"}:
            missing = "attn_v_b" if "k" in pair else "attn_k_b"
            raise CheckpointError(
                f"GGUF file {f.path}: layer {layer} has no {missing} "
                f"(attn_k_b and attn_v_b make kv_b_proj together)"
            )
        k, v = pair["k"], pair["v"]
        heads, lora, nope = k.shape
        if len(v.shape) != 3 or v.shape[0] != heads or v.shape[2] != lora:
            raise CheckpointError(
                f"GGUF file {f.path}: {k.name} {k.shape} and {v.name} {v.shape} are not the "
                f"halves of one kv_b_proj ([heads, kv_lora, nope] and [heads, v, kv_lora])"
            )
        out[KV_B.format(layer=layer)] = JoinedEntry(k, v, (heads * (nope + v.shape[1]), lora))
    return out
