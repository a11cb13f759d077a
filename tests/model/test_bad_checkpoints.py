"""Bad checkpoints are refused with a CheckpointError that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from seamline.errors import CheckpointError, ConfigError
from seamline.weights.loader import load_stage, open_source
from tests.support.reference import save_random_model

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("good")
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    save_random_model(config, folder)
    return folder


def _edited(good: Path, tmp_path: Path, edit: object) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(good, folder)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_missing_tensor(good: Path, tmp_path: Path) -> None:
    folder = _edited(good, tmp_path, lambda t: t.pop(Q_PROJ))
    with pytest.raises(CheckpointError, match=f"missing tensor {Q_PROJ}"):
        load_stage(open_source(folder))


def test_wrong_shape(good: Path, tmp_path: Path) -> None:
    folder = _edited(good, tmp_path, lambda t: t.update({Q_PROJ: torch.zeros(32, 31)}))
    with pytest.raises(CheckpointError, match=f"{Q_PROJ} gives layers.1.attn.qkv shape"):
        load_stage(open_source(folder))


def test_wrong_dtype(good: Path, tmp_path: Path) -> None:
    folder = _edited(
        good, tmp_path, lambda t: t.update({Q_PROJ: torch.zeros(32, 32, dtype=torch.int32)})
    )
    with pytest.raises(CheckpointError, match=f"{Q_PROJ} has dtype torch.int32"):
        load_stage(open_source(folder))


def test_unexpected_tensor(good: Path, tmp_path: Path) -> None:
    folder = _edited(good, tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor model.extra.weight"):
        load_stage(open_source(folder))


def test_truncated_safetensors(good: Path, tmp_path: Path) -> None:
    folder = tmp_path / "truncated"
    shutil.copytree(good, folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors is not a valid safetensors file"):
        load_stage(open_source(folder))


def test_folder_without_config(good: Path, tmp_path: Path) -> None:
    folder = tmp_path / "noconfig"
    shutil.copytree(good, folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_stage(open_source(folder))


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        open_source(tmp_path / "nowhere")


def test_unsupported_architecture(good: Path, tmp_path: Path) -> None:
    folder = tmp_path / "arch"
    shutil.copytree(good, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'"):
        load_stage(open_source(folder))
