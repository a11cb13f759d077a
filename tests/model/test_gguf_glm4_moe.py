"""GLM-4.5-style MoE as llama.cpp writes it to GGUF (architecture ``glm4moe``): its pre-feed-
forward norm named ``post_attention_norm``, the router's correction bias ``exp_probs_b``, shared
experts ``*_shexp``, ``rope.dimension_count`` as the rotary share of each head. A random
checkpoint written that way reads back as the Hugging Face model: logits within 1e-4 (float32);
a Q8_0 file's logits follow the float model's."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from seamline.weights.gguf import GGUFSource
from seamline.weights.gguf_write import write_gguf_from_folder
from tests.support.family_checks import assert_gguf_follows, assert_gguf_matches
from tests.support.glm import save_glm

ATOL = 1e-4


def test_glm4_moe_gguf_reads_back_as_the_folder(tmp_path: Path) -> None:
    model = save_glm(tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "glm.gguf", "F32")
    config = GGUFSource(path).config_dict()
    assert config["model_type"] == "glm4_moe" and config["partial_rotary_factor"] == 0.5
    assert (config["first_k_dense_replace"], config["n_group"], config["use_qk_norm"]) == (
        1,
        2,
        True,
    )
    want = assert_gguf_matches(model, path)
    assert_gguf_follows(
        want, write_gguf_from_folder(tmp_path / "hf", tmp_path / "glm-q8.gguf", "Q8_0")
    )


def test_the_nextn_block_llama_cpp_keeps_is_left_out(tmp_path: Path) -> None:
    """llama.cpp's converter keeps GLM's multi-token-prediction layer as one more block (its
    ``nextn.*`` tensors beside a block's usual ones) and counts it in the block count."""
    model = save_glm(tmp_path / "hf")
    plain = write_gguf_from_folder(tmp_path / "hf", tmp_path / "glm.gguf", "F32")
    reader = gguf.GGUFReader(str(plain))
    layers = int(reader.fields["glm4moe.block_count"].contents())
    w = gguf.GGUFWriter(str(tmp_path / "nextn.gguf"), "glm4moe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (
            "general.architecture",
            "glm4moe.block_count",
        ):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    w.add_block_count(layers + 1)
    w.add_uint32("glm4moe.nextn_predict_layers", 1)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape([int(n) for n in reversed(t.shape)]))
    hidden = int(reader.fields["glm4moe.embedding_length"].contents())
    w.add_tensor(f"blk.{layers}.nextn.eh_proj.weight", np.zeros((hidden, 2 * hidden), np.float32))
    w.add_tensor(f"blk.{layers}.attn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = GGUFSource(tmp_path / "nextn.gguf").config_dict()
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (layers, 1)
    assert_gguf_matches(model, tmp_path / "nextn.gguf")
