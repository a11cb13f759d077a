"""A stage computes on the device it is placed on (``seamline.model.devices``): a step's input crosses
in once and its output out once, and nothing else moves. Checked on the meta device, where a
tensor made on the CPU mid-step, or one read back to the host (``.item()``, ``.tolist()``),
raises: the same code then runs on a GPU without a hidden copy per layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.app import default_model_path
from seamline.errors import ConfigError
from seamline.model.cache import Span
from seamline.model.devices import module_device, place_stage, resolve_device, to_host
from seamline.model.stage import Stage
from seamline.ownership import Ownership
from seamline.weights.loader import load_stage, open_source
from tests.support.configs import dense_configs
from tests.support.family_folders import build_gemma3_folder
from tests.support.reference import save_random_model

META = torch.device("meta")
DENSE = ("qwen2", "qwen3", "llama3-rope", "llama-tied")


def _folder(kind: str, tmp_path: Path) -> Path:
    if kind == "embedded":
        return default_model_path()
    if kind == "gemma3":
        return build_gemma3_folder(tmp_path)
    save_random_model(dense_configs()[kind], tmp_path)
    return tmp_path


def _meta_steps(stage: Stage) -> None:
    """A prefill, a decode step and a batched step (a decode row beside a prefill chunk), each
    past a sliding window where the family has one, all on the meta device."""
    vocab = stage.config.vocab_size
    first, second = stage.new_cache(), stage.new_cache()
    out = stage.forward(torch.arange(20), 0, first)
    assert out.device == META and tuple(out.shape) == (20, vocab)
    out = stage.forward(torch.tensor([3]), 20, first)
    assert out.device == META and tuple(out.shape) == (1, vocab)
    spans = [Span(0, 1, 21, first), Span(1, 9, 0, second)]
    out = stage.forward_batch(torch.arange(10), spans, last_only=True)
    assert out.device == META and tuple(out.shape) == (2, vocab)


@pytest.mark.parametrize("kind", ["embedded", "gemma3", *DENSE])
def test_a_step_keeps_every_tensor_on_the_stage_device(kind: str, tmp_path: Path) -> None:
    """Quantized (the embedded GGUF) and float families; Gemma 3 with its sliding window."""
    stage = load_stage(open_source(_folder(kind, tmp_path)), dtype=torch.float32)
    place_stage(stage, META)
    assert all(p.device == META for p in stage.parameters())
    _meta_steps(stage)


def test_a_split_stage_keeps_its_hidden_frame_on_the_device(tmp_path: Path) -> None:
    """A middle stage takes a hidden frame from the host and hands its own back on its device."""
    source = open_source(_folder("qwen3", tmp_path))
    stage = load_stage(source, Ownership(layers=(1, 2)), dtype=torch.float32)
    place_stage(stage, META)
    out = stage.forward(torch.zeros(6, stage.config.hidden_size), 0, stage.new_cache())
    assert out.device == META and tuple(out.shape) == (6, stage.config.hidden_size)


def test_a_stage_spans_an_accelerator_and_the_cpu(tmp_path: Path) -> None:
    """``gpu_layers``: the first layers and the embedding on the accelerator, the rest and the
    head (untied) on the CPU, as llama.cpp's -ngl places them."""
    stage = load_stage(open_source(_folder("qwen2", tmp_path)), dtype=torch.float32)
    place_stage(stage, META, gpu_layers=2)
    devices = [module_device(block).type for block in stage.layers.values()]
    assert devices == ["meta", "meta", "cpu"]
    assert isinstance(stage.embed, torch.Tensor) and stage.embed.device == META
    assert stage.input_device == META
    assert stage.norm is not None and stage.norm.weight.device.type == "cpu"
    assert isinstance(stage.head, torch.Tensor) and stage.head.device.type == "cpu"


def test_a_tied_head_stays_one_table_when_moved(tmp_path: Path) -> None:
    stage = load_stage(open_source(_folder("llama-tied", tmp_path)), dtype=torch.float32)
    place_stage(stage, META)
    assert stage.head is stage.embed and stage.embed.device == META  # type: ignore[union-attr]
    spanned = load_stage(open_source(tmp_path), dtype=torch.float32)
    place_stage(spanned, META, gpu_layers=1)  # the shared table stays with the head, on the CPU
    assert spanned.head is spanned.embed and spanned.embed.device.type == "cpu"  # type: ignore[union-attr]


def test_devices_are_named_as_users_write_them() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    )
    assert resolve_device(None).type in ("cpu", "cuda")
    with pytest.raises(ConfigError, match="--device tpu"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="not a device"):
        resolve_device("gpu-please")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the line a machine without CUDA gives"
)
def test_cuda_without_cuda_is_one_clear_line() -> None:
    with pytest.raises(
        ConfigError, match=r"--device cuda:1: torch sees no CUDA device \(torch .*\)"
    ):
        resolve_device("cuda:1")


def test_a_cpu_tensor_crosses_to_the_host_as_itself() -> None:
    t = torch.arange(4)
    assert to_host(t) is t


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the line a machine without CUDA gives"
)
def test_run_on_a_missing_gpu_says_so_in_one_line() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "seamline.cli", "run", "--device", "cuda", "-p", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("seamline: error: --device cuda: torch sees no CUDA device")
    )
