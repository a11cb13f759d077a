"""gpt-oss as llama.cpp writes it to GGUF (architecture ``gpt-oss``): gate, up and down experts
stacked apart with their biases, the router's bias, a sink logit per head (``attn_sinks``), and,
as llama.cpp ships it, the experts in MXFP4 (type 39). A float file reads back as the Hugging
Face model; an MXFP4 one keeps its experts at their size as fp4 weights whose values are gguf-py's
own decoding of the blocks: logits within 1e-4 (float32) of transformers over those weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from seamline.quant.scaled import ScaledTensor
from seamline.weights.gguf import GGUFSource
from seamline.weights.gguf_write import write_gguf_from_folder
from seamline.weights.loader import load_stage, open_source
from tests.support.family_checks import assert_gguf_matches
from tests.support.oss import OSS, save_oss
from tests.support.reference import random_ids, reference_logits, seamline_logits

ATOL = 1e-4


def _experts_mxfp4(name: str, shape: tuple[int, ...]) -> Q:
    return Q.MXFP4 if name.endswith("_exps.weight") else Q.F32


def _load_file_experts(model: torch.nn.Module, path: Path) -> None:
    """Set ``model``'s experts to what the file's blocks hold, as gguf-py decodes them."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for i, layer in enumerate(model.model.layers):

        def decoded(key: str) -> torch.Tensor:
            t = tensors[f"blk.{i}.{key}.weight"]  # noqa: B023 (called at once)
            return torch.from_numpy(
                gguf.quants.dequantize(t.data, t.tensor_type).copy()
            )  # [E, out, in]

        gate, up, down = decoded("ffn_gate_exps"), decoded("ffn_up_exps"), decoded("ffn_down_exps")
        with torch.no_grad():
            layer.mlp.experts.gate_up_proj[:, :, 0::2] = gate.transpose(1, 2)
            layer.mlp.experts.gate_up_proj[:, :, 1::2] = up.transpose(1, 2)
            layer.mlp.experts.down_proj.copy_(down.transpose(1, 2))


def test_a_float_gpt_oss_gguf_reads_back_as_the_folder(tmp_path: Path) -> None:
    model = save_oss(tmp_path / "hf", truncate=True)  # as a GGUF runs it: llama.cpp's ramp
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "oss.gguf", "F32")
    config = GGUFSource(path).config_dict()
    assert config["model_type"] == "gpt_oss" and config["rope_scaling"]["truncate"] is True
    assert_gguf_matches(model, path)


def test_mxfp4_gguf_experts_stay_at_their_size(tmp_path: Path) -> None:
    model = save_oss(tmp_path / "hf", truncate=True)  # as a GGUF runs it: llama.cpp's ramp
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "oss-mxfp4.gguf", _experts_mxfp4)
    stage = load_stage(open_source(path))
    experts = stage.layers["0"].ffn.experts_gate_up
    assert isinstance(experts, ScaledTensor) and experts.kind == "fp4"
    e, rows, cols = OSS["num_local_experts"], 2 * OSS["intermediate_size"], OSS["hidden_size"]
    assert experts.values.numel() == e * rows * cols // 2  # the file's 16 code bytes a block of 32
    _load_file_experts(model, path)
    ids = random_ids(256)
    got = seamline_logits(stage, ids)
    assert (got - reference_logits(model, ids)).abs().max().item() < ATOL
    assert np.isfinite(got.numpy()).all()
