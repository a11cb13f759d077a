"""Which GGUF type each tensor of a written file gets: llama.cpp's quantisation mixes as data.

A policy is a callable ``(gguf_name, torch_shape) -> GGMLQuantizationType``. ``preset_policy``
builds llama.cpp's (``llama-quant.cpp``, ``llama_tensor_get_type``) for a file type:

* never quantised: 1-D tensors, names not ending in ``weight``, ``*_norm.weight``, the router
  ``ffn_gate_inp.weight`` -- these stay F32;
* ``output.weight`` (and ``token_embd.weight`` when it doubles as the output): Q6_K, or Q8_0
  when the preset is Q8_0 or a row is not whole 256-blocks;
* Q4_K_M: Q6_K for the value projection (``attn_v``, ``attn_qkv``, ``attn_kv_b``) and
  ``ffn_down*`` of the "use_more_bits" layers -- the first and last eighth and every third in
  between, about half -- else Q4_K; 8-expert models (Mixtral) take attn_v and attn_k as Q8_0
  and attn_output as Q5_K;
* a row length the chosen type's block does not divide falls back as llama.cpp does (Q4_K ->
  Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), and to F16 when even that does not divide it (as the
  converter does for Q8_0).

A float preset (F32, F16, BF16) writes every quantisable tensor in that type, norms in F32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

TypePolicy = Callable[[str, tuple[int, ...]], Q]

# preset name -> the file type's default tensor type
PRESETS: dict[str, Q] = {
    "F32": Q.F32,
    "F16": Q.F16,
    "BF16": Q.BF16,
    "Q8_0": Q.Q8_0,
    "Q4_0": Q.Q4_0,
    "Q4_1": Q.Q4_1,
    "Q5_0": Q.Q5_0,
    "Q5_1": Q.Q5_1,
    "Q4_K_M": Q.Q4_K,
}
FLOAT_PRESETS = frozenset({"F32", "F16", "BF16"})

# llama.cpp's fallback for a row length its block size does not divide
FALLBACK: dict[Q, Q] = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}

# substrings of names llama.cpp never quantises
KEEP_FLOAT = ("_norm.weight", "ffn_gate_inp.weight")
ATTN_V_LIKE = ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")


@dataclass(frozen=True)
class ModelShape:
    """What llama.cpp's mix rules look at, besides a tensor's name and shape."""

    layers: int
    experts: int  # 0 for a dense model
    tied: bool  # no output.weight: token_embd doubles as the output head
    value_layers: int  # tensors counted as attn_v (one per layer, or 0 when absent)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp: the first and last eighth of the layers, and every third one in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def preset_policy(preset: str, model: ModelShape) -> TypePolicy:
    if preset not in PRESETS:
        raise ValueError(f"unknown GGUF type preset {preset!r}; presets: {', '.join(PRESETS)}")

    def policy(name: str, shape: tuple[int, ...]) -> Q:
        if not quantisable(name, shape):
            return Q.F32
        if preset in FLOAT_PRESETS:
            return PRESETS[preset]
        return fit_row(mixed_type(preset, name, shape, model), shape[-1])

    return policy


def quantisable(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and name.endswith("weight") and not any(k in name for k in KEEP_FLOAT)


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def mixed_type(preset: str, name: str, shape: tuple[int, ...], model: ModelShape) -> Q:
    """llama_tensor_get_type for the presets seamline writes (before the row-length fallback)."""
    default = PRESETS[preset]
    is_output = name == "output.weight" or (model.tied and name == "token_embd.weight")
    if is_output:
        if shape[-1] % 256 or default == Q.Q8_0:
            return Q.Q8_0
        return Q.Q6_K
    eight_experts = model.experts == 8
    if any(k in name for k in ATTN_V_LIKE):
        if eight_experts:
            return Q.Q8_0
        more = preset == "Q4_K_M" and use_more_bits(_layer(name), model.value_layers)
        return Q.Q6_K if more else default
    if "attn_k.weight" in name and eight_experts:
        return Q.Q8_0
    if "attn_output.weight" in name and eight_experts and preset == "Q4_K_M":
        return Q.Q5_K
    if "ffn_down" in name and preset == "Q4_K_M" and use_more_bits(_layer(name), model.layers):
        return Q.Q6_K
    return default


def fit_row(qtype: Q, cols: int) -> Q:
    """llama.cpp's fallback when ``cols`` is not whole blocks of ``qtype``."""
    if cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = FALLBACK.get(qtype, Q.F16)
    return qtype if cols % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16
