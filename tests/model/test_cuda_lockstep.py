"""A lockstep group whose ranks compute on GPUs (skipped with the reason where there is none):
ranks sharing one GPU keep to the TCP mesh (their gates copy to the host); ranks on GPUs of
their own use NCCL. Either gives the single-process CPU engine's greedy tokens, and its logits
within ``ATOL_GPU`` (the GPU sums in another order than the CPU; random float32 weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.runtime.engine import Engine
from seamline.weights.loader import load_stage, open_source
from tests.support.configs import checkpoint_folder
from tests.support.lockstep_harness import PROMPT, engine_reference, run_group

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)"
)
ATOL_GPU = 1e-3  # random checkpoints' logits are within a few units: 1e-3 is ~1e-4 of their scale


def _reference(tmp_path: Path):  # type: ignore[no-untyped-def]
    model = checkpoint_folder("mixtral", tmp_path)
    return model, engine_reference(Engine(load_stage(open_source(model))), PROMPT)


def test_two_ranks_on_one_gpu_over_tcp_give_the_engine(tmp_path: Path) -> None:
    model, ref = _reference(tmp_path)
    run_group(model, 2, ref, ATOL_GPU, transport="tcp", devices=["cuda:0", "cuda:0"])


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL takes one rank per GPU: needs two GPUs"
)
def test_two_ranks_on_two_gpus_over_nccl_give_the_engine(tmp_path: Path) -> None:
    model, ref = _reference(tmp_path)
    run_group(model, 2, ref, ATOL_GPU, transport="torch", devices=["cuda:0", "cuda:1"])
