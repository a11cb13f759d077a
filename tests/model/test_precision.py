"""Precision: what a user gets with no flags is the fast path (bfloat16 activations, int8 blocks
in the GGUF matmuls), ``--precision exact`` the dequantised float32 answers, and no step of the
exact path dequantises a whole weight matrix however many rows it multiplies.

Mesh stages reporting the coordinator's precision are tested in test_mesh.py."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from seamline.app import LocalModel, default_model_path
from seamline.errors import ConfigError
from seamline.model.cache import Span
from seamline.precision import resolve, weights_kind
from seamline.quant import matmul
from seamline.quant.native import kernels
from seamline.quant.tensor import QuantTensor
from tests.support.mesh import expected_text

needs_kernels = pytest.mark.skipif(
    kernels() is None, reason="the int8-block kernels need x86-64 with AVX2 and a compiler"
)
SEQUENCES = 16


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "seamline.cli", "run", "--max-tokens", "24", "--verbose", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_kernels
def test_no_flags_run_the_int8_block_path_and_answer() -> None:
    question = "List three prime numbers."
    proc = _run("-p", question)
    assert proc.returncode == 0, proc.stderr
    assert "precision: fast (bfloat16 activations, int8 blocks in the matmuls)" in proc.stderr, (
        proc.stderr
    )
    # the fast path's greedy words as this machine computes them in one process: they hang on the
    # prefill's rounding ("2, 3, 5" from AMX tiles, "1. 1 2. 2 3. 3" from bfloat16 tiles)
    want = expected_text(LocalModel.load(precision="fast"), question, 24)
    assert proc.stdout.strip() == want.strip(), (proc.stdout, want)
    assert re.search(
        r"prompt eval: \d+ tokens in [\d.]+ ms \([\d.]+ tokens/s\)\ntime to first token: [\d.]+ ms\n"
        r"decode: \d+ tokens in [\d.]+ ms \([\d.]+ tokens/s, [\d.]+ ms/token\)",
        proc.stderr,
    ), proc.stderr


def test_the_exact_flag_answers_as_the_dequantised_float32_model() -> None:
    proc = _run("-p", "What is the capital of France?", "--precision", "exact")
    assert proc.returncode == 0, proc.stderr
    assert "precision: exact (float32 activations)" in proc.stderr, proc.stderr
    assert "Paris" in proc.stdout, proc.stdout


def test_a_bad_precision_is_one_clear_line() -> None:
    proc = _run("-p", "hi", "--precision", "fastest")
    assert proc.returncode == 2 and "invalid choice: 'fastest'" in proc.stderr, proc.stderr
    with pytest.raises(ConfigError, match="unknown precision 'fastest'"):
        resolve("fastest", "quantized")


def test_the_precision_follows_the_weights() -> None:
    assert weights_kind(["Q4_1", "float32", "Q8_0"]) == "quantized"
    assert weights_kind(["float8_e4m3", "bfloat16"]) == "quantized"
    assert weights_kind(["bfloat16", "bfloat16", "float32"]) == "bfloat16"
    assert weights_kind(["float16", "float32", "float16"]) == "float16"
    for kind, fast_dtype in (
        ("bfloat16", "bfloat16"),
        ("float32", "float32"),
        ("float16", "float16"),
    ):
        fast = resolve("fast", kind)
        assert (fast.dtype, fast.int8_activations) == (fast_dtype, False), (
            kind
        )  # int8 blocks are GGUF's alone
        assert resolve("exact", kind).dtype == "float32"
    assert resolve("fast", "quantized").dtype == "bfloat16"
    assert resolve("fast", "quantized").int8_activations == (kernels() is not None)
    assert resolve("fast", "quantized", "float32").dtype == "float32"  # --dtype overrides
    assert resolve("exact", "quantized") == resolve("exact", "quantized", "float32")
    assert not resolve("exact", "quantized").int8_activations


@pytest.fixture
def whole_matrix_dequantised() -> Iterator[list[tuple[int, ...]]]:
    """Every whole 2-D weight the exact path dequantises (it must be none)."""
    seen: list[tuple[int, ...]] = []
    real = matmul.dequantize

    def spy(w: QuantTensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(w.shape)
        return real(w, *args, **kwargs)  # type: ignore[arg-type]

    matmul.dequantize = spy  # type: ignore[assignment]
    try:
        yield seen
    finally:
        matmul.dequantize = real


@needs_kernels
def test_a_batched_exact_step_equals_its_rows_alone(whole_matrix_dequantised: list) -> None:
    """16 sequences decoding in one step give each one's logits alone (within 1e-5; on the
    blocks a row's sums do not depend on the rows beside it), and no weight is dequantised."""
    stage = LocalModel.load(precision="exact").engine.stage
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (3 + i % 5,), generator=gen) for i in range(SEQUENCES)]
    caches = [stage.new_cache() for _ in prompts]
    nexts = [int(stage(p, 0, c, last_only=True)[-1].argmax()) for p, c in zip(prompts, caches)]
    copies = [c.fork(len(p)) for p, c in zip(prompts, caches)]
    whole_matrix_dequantised.clear()
    spans = [Span(i, 1, len(p), c) for i, (p, c) in enumerate(zip(prompts, caches))]
    batched = stage.forward_batch(torch.tensor(nexts), spans).float()
    alone = torch.cat(
        [stage(torch.tensor([t]), len(p), c)[-1:] for t, p, c in zip(nexts, prompts, copies)]
    ).float()
    assert (batched - alone).abs().max().item() <= 1e-5
    assert whole_matrix_dequantised == []


def test_without_kernels_a_weight_is_dequantised_a_tile_at_a_time(
    whole_matrix_dequantised: list,
) -> None:
    """The torch path (no kernels, other devices) multiplies row tiles of at most TILE_BYTES."""
    from seamline.quant.dequant import dequantize
    from seamline.weights.loader import open_source

    head = open_source(default_model_path()).get("model.embed_tokens.weight")  # [49152, 576], Q8_0
    assert isinstance(head, QuantTensor)
    x = torch.randn(20, head.shape[1], generator=torch.Generator().manual_seed(1))
    got = matmul.quant_linear(x, head, use_kernels=False)
    pieces = list(whole_matrix_dequantised)
    expected = torch.nn.functional.linear(x, dequantize(head))
    assert (got - expected).abs().max().item() <= 1e-4
    assert len(pieces) > 1 and all(rows * cols * 4 <= matmul.TILE_BYTES for rows, cols in pieces), (
        pieces[:3]
    )


def test_run_on_an_unrunnable_model_path_is_still_one_line(tmp_path: Path) -> None:
    proc = _run("-p", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert proc.returncode == 1 and proc.stderr.strip().startswith("seamline: error:"), proc.stderr
    assert default_model_path().is_file()
