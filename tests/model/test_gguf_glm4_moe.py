"""GLM-4.5-style MoE as llama.cpp writes it to GGUF (architecture ``glm4moe``): its pre-feed-
forward norm named ``post_attention_norm``, the router's correction bias ``exp_probs_b``, shared
experts ``*_shexp``, ``rope.dimension_count`` as the rotary share of each head. A random
checkpoint written that way reads back as the Hugging Face model: logits within 1e-4 (float32);
a Q8_0 file's logits follow the float model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from seamline.weights.gguf import GGUFSource
from seamline.weights.gguf_write import write_gguf_from_folder
from seamline.weights.loader import load_stage, open_source
from tests.support.glm import save_glm
from tests.support.reference import random_ids, reference_logits, seamline_logits

ATOL = 1e-4


def test_glm4_moe_gguf_reads_back_as_the_folder(tmp_path: Path) -> None:
    model = save_glm(tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "glm.gguf", "F32")
    config = GGUFSource(path).config_dict()
    assert config["model_type"] == "glm4_moe" and config["partial_rotary_factor"] == 0.5
    assert (config["first_k_dense_replace"], config["n_group"], config["use_qk_norm"]) == (1, 2, True)
    ids = random_ids(256)
    want = reference_logits(model, ids)
    assert (seamline_logits(load_stage(open_source(path)), ids) - want).abs().max().item() < ATOL
    quantized = write_gguf_from_folder(tmp_path / "hf", tmp_path / "glm-q8.gguf", "Q8_0")
    got = seamline_logits(load_stage(open_source(quantized)), ids)
    assert np.corrcoef(got.flatten().numpy(), want.flatten().numpy())[0, 1] > 0.99
