"""Bad quantized input: a clear one-line error naming the tensor and its type, before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import transformers

from seamline.app import default_model_path
from seamline.errors import CheckpointError
from seamline.weights.fragments import FragmentEntry, FragmentSource, model_hash
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_write import write_gguf_from_folder
from seamline.weights.loader import load_stage, open_source
from seamline.weights.packaging import package
from tests.support.reference import save_random_model

TARGET = "blk.1.ffn_down.weight"  # a Q8_0 tensor of the file below
HF_TARGET = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bad_q8")
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    save_random_model(config, folder / "hf")
    # the embedded model's tokenizer, so that the file packages like a real one
    return write_gguf_from_folder(
        folder / "hf", folder / "m.gguf", "Q8_0", tokenizer_from=default_model_path()
    )


def _patched(path: Path, out: Path, at: int, value: bytes) -> Path:
    data = bytearray(path.read_bytes())
    data[at : at + len(value)] = value
    out.write_bytes(bytes(data))
    return out


def test_a_block_with_an_infinite_scale_is_named(q8_file: Path, tmp_path: Path) -> None:
    info = GGUFFile.open(q8_file).tensors[TARGET]
    block = 3  # Q8_0: 34-byte blocks, the float16 scale first
    inf = np.float16(np.inf).tobytes()
    bad = _patched(q8_file, tmp_path / "bad.gguf", info.offset + block * 34, inf)
    with pytest.raises(
        CheckpointError, match=rf"{HF_TARGET} \(Q8_0\) is corrupt: block 3 .*infinite or NaN"
    ):
        load_stage(open_source(bad))


def test_a_truncated_tensor_is_named(q8_file: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.gguf"
    short.write_bytes(q8_file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"truncated: tensor '.*' needs bytes"):
        open_source(short)


def test_fragment_bytes_that_do_not_match_type_and_shape(q8_file: Path, tmp_path: Path) -> None:
    """A manifest (its hash recomputed) whose tensor entry claims a shape its bytes do not hold."""
    folder = tmp_path / "pkg"
    data = package(q8_file, folder, progress=False).to_json()
    for fragment in data["fragments"]:
        for tensor in fragment["tensors"]:
            if tensor["name"] == HF_TARGET:
                assert tensor["dtype"] == "Q8_0"
                tensor["shape"] = [tensor["shape"][0] * 2, tensor["shape"][1]]
    entries = [FragmentEntry.from_json(f) for f in data["fragments"]]
    data["model_hash"] = model_hash(data["config"], entries)
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(
        CheckpointError, match=rf"tensor {HF_TARGET} in fragment layer.1: Q8_0 blocks"
    ):
        FragmentSource(folder).get(HF_TARGET)
