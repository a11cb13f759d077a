"""GGUFSource: a llama.cpp GGUF file as a TensorSource with Hugging Face names and layouts.

Opening the file parses its header and refuses, up front and in one line naming the file and
tensor, anything ``get`` could not serve: an unsupported architecture, a tensor the name
tables do not know, a quantisation type outside ``SUPPORTED_TYPES``, bytes missing from the
end of the file. ``get`` then reads one tensor lazily from the memory map and undoes
llama.cpp's Q/K row permutation. A tensor of one of ``QUANT_TYPES`` comes back as a
``QuantTensor`` holding its GGUF blocks unchanged (copied out of the map, so the loaded model
owns its memory); F32, F16 and BF16 as tensors of that dtype; the other types (Q2_K, Q3_K,
the IQ types) dequantised with ``gguf.quants.dequantize`` to bfloat16.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from seamline.errors import CheckpointError
from seamline.quant.scaled import KIND_NAMES
from seamline.quant.tensor import QUANT_TYPES, QuantTensor
from seamline.weights.gguf_config import PERMUTED_ARCHS, config_dict, family_of
from seamline.weights.gguf_file import GGUFFile, TensorInfo
from seamline.weights.gguf_mla import JoinedEntry, joined_entries
from seamline.weights.gguf_mxfp4 import mxfp4_blocks
from seamline.weights.gguf_names import CONSUMED_NAMES, JOINED_KEYS, hf_names
from seamline.weights.gguf_tokenizer import (
    GGUFTokenizerInfo,
    chat_template_from_gguf,
    tokenizer_from_gguf,
    tokenizer_info_from_gguf,
)

__all__ = [
    "SUPPORTED_TYPES",
    "GGUFSource",
    "GGUFTokenizerInfo",
    "chat_template_from_gguf",
    "tokenizer_from_gguf",
    "tokenizer_info_from_gguf",
    "unpermute_rows",
]

# Types whose dequantisation the tests check against an independent implementation.
SUPPORTED_TYPES: frozenset[Q] = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q8_0,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
        Q.IQ1_S,
        Q.IQ1_M,
        Q.IQ2_XXS,
        Q.IQ2_XS,
        Q.IQ2_S,
        Q.IQ3_XXS,
        Q.IQ3_S,
        Q.IQ4_NL,
        Q.IQ4_XS,
        Q.MXFP4,
    }
)


# GGUF float types -> the torch dtype they load in (gguf-py dequantises them to float32)
_FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


class _Entry(NamedTuple):
    info: TensorInfo
    expert: int | None  # index into a stacked [E, ...] tensor
    heads: int | None  # un-permute rows in this many head groups (llama Q/K), or None
    shape: tuple[int, ...]  # HF shape


class GGUFSource:
    """A GGUF checkpoint (llama, qwen2, qwen3, mixtral-as-llama, qwen3moe) under HF names.

    The constructor opens and validates the whole file (header only; no tensor data is read
    except the tiny ``rope_freqs`` tensor of Llama-3 files), raising ``CheckpointError``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.file = GGUFFile.open(self.path)
        self.family = family_of(self.file)
        _check_types(self.file)
        rope = self.file.tensors.get("rope_freqs.weight")
        freqs = _dequantize(self.file, rope, None) if rope is not None else None
        self._config = config_dict(self.file, self.family, freqs)
        self._entries = _map_tensors(self.file, self.family, self._config)

    def names(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def get(self, name: str) -> torch.Tensor | QuantTensor:
        entry = self._entry(name)
        if isinstance(entry, JoinedEntry):  # kv_b_proj from attn_k_b + attn_v_b (gguf_mla)
            return entry.read(self.file)
        qtype = entry.info.qtype
        if qtype in QUANT_TYPES:
            raw = self.file.raw(entry.info)  # [*shape[:-1], row_bytes]: rows are whole blocks
            raw = raw[entry.expert] if entry.expert is not None else raw
            if entry.heads is not None:
                raw = unpermute_rows(raw, entry.heads)
            data = torch.from_numpy(np.array(raw, dtype=np.uint8))  # a copy: owns its memory
            return QuantTensor(qtype, data, entry.shape)
        if qtype == Q.MXFP4:  # gpt-oss's experts, kept at their size as fp4 weights
            raw = self.file.raw(entry.info)
            try:
                return mxfp4_blocks(
                    np.array(raw[entry.expert] if entry.expert is not None else raw)
                )
            except CheckpointError as exc:
                raise CheckpointError(f"tensor {entry.info.name} (MXFP4): {exc}") from None
        values = _dequantize(self.file, entry.info, entry.expert).reshape(entry.shape)
        if entry.heads is not None:
            values = unpermute_rows(values, entry.heads)
        # a float tensor comes as a view of the read-only map: copy it
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))
        return tensor.to(_FLOAT_TYPES.get(qtype, torch.bfloat16))

    def stored_type(self, name: str) -> str:
        """A kept quant type's name, else the float dtype ``get`` returns."""
        entry = self._entry(name)
        if isinstance(entry, JoinedEntry):
            return "float32"  # MLA's kv_b, joined in float
        qtype = entry.info.qtype
        if qtype in QUANT_TYPES:
            return qtype.name
        if qtype == Q.MXFP4:
            return KIND_NAMES["fp4"]
        return str(_FLOAT_TYPES.get(qtype, torch.bfloat16)).removeprefix("torch.")

    def stored_bytes(self, name: str) -> int:
        """The bytes the tensor takes in the file (one expert's share of a stacked tensor)."""
        entry = self._entry(name)
        if isinstance(entry, JoinedEntry):
            return entry.k.nbytes + entry.v.nbytes
        return entry.info.nbytes // (entry.info.shape[0] if entry.expert is not None else 1)

    def config_dict(self) -> dict[str, Any]:
        return dict(self._config)

    def _entry(self, name: str) -> _Entry | JoinedEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"GGUF file {self.path} has no tensor '{name}'")
        return entry


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``reshape(heads, 2, half, *rest).swapaxes(1, 2)`` on Q/K rows."""
    rows = w.shape[0]
    # [rows, *rest] -> [heads, half, 2, *rest] -> [heads, 2, half, *rest] -> [rows, *rest]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(f: GGUFFile, info: TensorInfo, expert: int | None) -> np.ndarray:
    raw = f.raw(info)  # uint8 [*shape[:-1], bytes_per_row]
    if expert is not None:
        raw = raw[expert]
    qtype = info.qtype
    if qtype is None:  # _check_types refuses these at open
        raise CheckpointError(f"GGUF file {f.path}: tensor '{info.name}' has {info.type_name}")
    return dequantize(raw, qtype)


def _check_types(f: GGUFFile) -> None:
    for info in f.tensors.values():
        if info.qtype not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise CheckpointError(
                f"GGUF file {f.path}: tensor '{info.name}' is stored as {info.type_name}, "
                f"which seamline cannot dequantise (supported: {supported})"
            )


def _map_tensors(
    f: GGUFFile, family: str, config: dict[str, Any]
) -> dict[str, _Entry | JoinedEntry]:
    """Every GGUF tensor -> its HF name(s); a tensor the tables do not know is refused."""
    arch = str(f.get("general.architecture"))
    groups = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    entries: dict[str, _Entry | JoinedEntry] = {}
    for info in f.tensors.values():
        key = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        if info.name in CONSUMED_NAMES or key in JOINED_KEYS:
            continue  # joined below
        if key and int(info.name.split(".")[1]) >= config["num_hidden_layers"]:
            continue  # a block past the model's layers: GLM-4.5's multi-token prediction (nextn)
        names = hf_names(info.name, family, info.shape[0])
        if names is None:
            raise CheckpointError(
                f"GGUF file {f.path}: tensor '{info.name}' has no Hugging Face name "
                f"for architecture {arch} (see seamline/weights/gguf_names.py)"
            )
        permute = groups.get(key) if arch in PERMUTED_ARCHS else None
        for hf in names:
            shape = info.shape[1:] if hf.expert is not None else info.shape
            if permute is not None and shape[0] % (2 * permute):
                raise CheckpointError(
                    f"GGUF file {f.path}: tensor '{info.name}' has {shape[0]} rows, "
                    f"not a multiple of 2 x {permute} heads"
                )
            if hf.name in entries:
                raise CheckpointError(f"GGUF file {f.path}: two tensors map to '{hf.name}'")
            entries[hf.name] = _Entry(info, hf.expert, permute, tuple(shape))
    for name, joined in joined_entries(f).items():
        if name in entries:
            raise CheckpointError(f"GGUF file {f.path}: two tensors map to '{name}'")
        entries[name] = joined
    return entries
