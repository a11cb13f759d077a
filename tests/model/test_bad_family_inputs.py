"""Bad input of the newer families, tried as a user would, refused in one line naming the field
and its value before anything runs: a ``layer_types`` entry seamline does not know or a list
short of the layers, a config that mixes fields of two families, an MXFP4 block whose scale is
no power of two, and a tokenizer whose ids reach past the model's embedding (a random
DeepSeek-V2 folder without tokenizer files, which takes DeepSeek's 128k vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers
from gguf import GGMLQuantizationType as Q

from seamline.config import ModelConfig
from seamline.errors import CheckpointError, ConfigError
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_write import write_gguf_from_folder
from seamline.weights.loader import load_stage, open_source
from tests.support.cli import assert_clean_error, seamline
from tests.support.deepseek import build_deepseek
from tests.support.oss import save_oss
from tests.support.reference import save_random_model

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


def _edit_config(folder: Path, **fields: Any) -> Path:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3")
    save_random_model(transformers.Qwen3Config(**SMALL), folder)
    return folder


@pytest.mark.parametrize(
    ("types", "said"),
    [
        (
            ["sliding_attention", "chunked_attention", "full_attention", "full_attention"],
            "layer_types[1] is 'chunked_attention'",
        ),
        (["sliding_attention", "full_attention"], "layer_types names 2 layers; the model has 4"),
    ],
)
def test_layer_types_seamline_does_not_know_are_one_line(
    qwen3: Path, tmp_path: Path, types: list[str], said: str
) -> None:
    folder = _edit_config(
        _copy(qwen3, tmp_path), layer_types=types, use_sliding_window=True, sliding_window=8
    )
    assert_clean_error(seamline("run", "--model", str(folder), "-p", "hi"), said)


@pytest.mark.parametrize(("field", "value"), [("num_local_experts", 4), ("kv_lora_rank", 32)])
def test_a_config_mixing_two_families_is_one_line(
    qwen3: Path, tmp_path: Path, field: str, value: int
) -> None:
    """A dense Qwen3 with Mixtral's experts or DeepSeek's latent attention would run as a dense
    Qwen3 without a word: refused, naming the field and its value."""
    folder = _edit_config(_copy(qwen3, tmp_path), **{field: value})
    assert_clean_error(
        seamline("run", "--model", str(folder), "-p", "hi"), f"sets {field} = {value}"
    )
    with pytest.raises(ConfigError, match=f"'qwen3' but it sets {field}"):
        ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))


def test_the_families_own_fields_pass() -> None:
    """Each field in a family that reads it (transformers 5 writes Qwen3-MoE's experts as num_local_experts)."""
    mixtral = transformers.MixtralConfig(**SMALL, num_local_experts=4).to_dict()
    qwen3_moe = transformers.Qwen3MoeConfig(
        **SMALL, num_experts=4, moe_intermediate_size=32
    ).to_dict()
    renamed = {k: v for k, v in qwen3_moe.items() if k != "num_experts"} | {"num_local_experts": 4}
    for d in (mixtral, qwen3_moe, renamed):
        assert ModelConfig.from_hf_dict(d).num_experts == 4


def test_an_mxfp4_scale_that_is_no_power_of_two_is_named(tmp_path: Path) -> None:
    """A gpt-oss GGUF with MXFP4 experts, one block's scale byte set to 0xFF (NaN in UE8M0)."""
    save_oss(tmp_path / "hf")
    path = write_gguf_from_folder(
        tmp_path / "hf",
        tmp_path / "oss.gguf",
        lambda name, shape: Q.MXFP4 if name.endswith("_exps.weight") else Q.F32,
    )
    info = next(
        t for t in GGUFFile.open(path).tensors.values() if t.name.endswith("ffn_gate_exps.weight")
    )
    data = bytearray(path.read_bytes())
    data[info.offset + 17] = 0xFF  # the second block's scale
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=rf"{info.name} \(MXFP4\): block scale 1 is the UE8M0 byte 0xFF"
    ):
        load_stage(open_source(path))


def test_a_tokenizer_past_the_embedding_is_one_line(tmp_path: Path) -> None:
    """A random DeepSeek-V2 folder (256 embedding rows) without tokenizer files takes DeepSeek's
    vocabulary: refused at load, not an IndexError at the first prompt."""
    _, folder = build_deepseek(tmp_path, "v2_lite_greedy")
    assert not (folder / "tokenizer.json").exists()
    assert_clean_error(
        seamline("run", "--model", str(folder), "-p", "hi"), "embedding has 256 rows"
    )


def _copy(folder: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, tmp_path / "copy"))
