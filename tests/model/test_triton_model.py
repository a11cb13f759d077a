"""A whole quantized model through the GPU's kernels, run here in Triton's interpreter on CPU
tensors: the GGUF matmuls (``quant/gpu_matmul.py``), the small ops and the decode attention are
routed as a CUDA tensor routes them, and the logits are the CPU exact path's (float32; 1e-4 of
their scale, for the order of the sums). Then a decode step as a replayed graph computes it: the
attention reads each row's position and cache from the tables ``runtime/cuda_graphs.py`` fills,
with padding rows, and gives the eager step's logits and caches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from seamline.model.cache import SequenceCache, Span
from seamline.weights.loader import load_stage, open_source
from tests.support.reference import save_random_model

pytest.importorskip("triton", reason="triton is a test dependency (pip install -e '.[test]')")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on CUDA test_cuda.py runs it"
)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    from seamline.weights.gguf_write import write_gguf_from_folder

    folder = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    save_random_model(config, folder / "hf")  # small: the interpreter runs every program in numpy
    return write_gguf_from_folder(
        folder / "hf", folder / "m.gguf", "Q5_1"
    )  # 32-wide blocks: 64 columns


@pytest.fixture
def gpu_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the routes CUDA tensors take: the Triton kernels, in the interpreter."""
    from seamline.model import attention, fused, gpu_ops, linear
    from seamline.quant import gpu_matmul

    def gpu_op(x: torch.Tensor, name: str):  # noqa: ANN202  (gpu_ops.op_for without its CUDA check)
        return gpu_ops.ops().get(name) if x.is_contiguous() and x.dtype == torch.float32 else None

    def gpu_linear(x: torch.Tensor, w, bias=None):  # noqa: ANN001, ANN202  (quant_linear's CUDA branch)
        return gpu_matmul.gguf_linear(x, w.data, w.qtype, w.shape[-1], bias)

    monkeypatch.setattr(linear, "quant_linear", gpu_linear)
    monkeypatch.setattr(fused, "op_for", gpu_op)
    monkeypatch.setattr(attention, "op_for", gpu_op)


def _steps(stage, prompts: list[list[int]], decode: int) -> list[torch.Tensor]:
    """Each prompt alone, then ``decode`` batched one-token steps of all: every step's logits."""
    caches = [stage.new_cache() for _ in prompts]
    out = [stage.forward(torch.tensor(p), 0, c, last_only=True) for p, c in zip(prompts, caches)]
    tokens = [int(o[-1].argmax()) for o in out]
    for step in range(decode):
        spans = [Span(i, 1, len(p) + step, c) for i, (p, c) in enumerate(zip(prompts, caches))]
        out.append(stage.forward_batch(torch.tensor(tokens), spans, last_only=True))
        tokens = [int(t) for t in out[-1].argmax(-1)]
    return out


def test_triton_kernels_run_a_quantized_model_as_the_cpu_does(
    gguf_model: Path, request: pytest.FixtureRequest
) -> None:
    prompts = [list(range(3, 10)), list(range(40, 44))]
    want = _steps(load_stage(open_source(gguf_model), dtype=torch.float32), prompts, 2)
    request.getfixturevalue("gpu_routes")
    got = _steps(load_stage(open_source(gguf_model), dtype=torch.float32), prompts, 2)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= TOLERANCE * w.abs().max().item()


def test_triton_decode_step_from_graph_tables_equals_eager(
    gguf_model: Path, gpu_routes: None
) -> None:
    """Two sequences and two padding rows (a bucket of 4), as a captured step runs them."""
    from seamline.model.gpu_static import static_tables
    from seamline.runtime.cuda_graphs import fill_tables

    stage = load_stage(open_source(gguf_model), dtype=torch.float32)
    prompts = [list(range(3, 10)), list(range(40, 44))]
    caches = [stage.new_cache() for _ in prompts]
    twins = [stage.new_cache() for _ in prompts]
    for p, c, t in zip(prompts, caches, twins):
        stage.forward(torch.tensor(p), 0, c)
        stage.forward(torch.tensor(p), 0, t)
    spans = [Span(i, 1, len(p), c) for i, (p, c) in enumerate(zip(prompts, caches))]
    want = stage.forward_batch(torch.tensor([5, 6]), spans, last_only=True)
    attention = [(int(i), block.attn) for i, block in stage.layers.items()]
    tables = np.zeros((len(attention), 4, 4), dtype=np.int64)
    scratch = SequenceCache([i for i, _ in attention])
    twin_spans = [Span(i, 1, len(p), t) for i, (p, t) in enumerate(zip(prompts, twins))]
    fill_tables(tables, attention, twin_spans, scratch, torch.float32, torch.device("cpu"))
    views = {layer: torch.from_numpy(tables[slot]) for slot, (layer, _) in enumerate(attention)}
    padded = [*twin_spans, Span(2, 1, 0, scratch), Span(3, 1, 0, scratch)]
    with static_tables(views):
        got = stage.forward_batch(torch.tensor([5, 6, 0, 0]), padded)
    assert (got[:2] - want).abs().max().item() <= TOLERANCE * want.abs().max().item()
    for layer, _ in attention:  # the step wrote each sequence's own cache at its position
        for p, c, t in zip(prompts, caches, twins):
            torch.testing.assert_close(
                t.layer(layer).k[:, len(p)], c.layer(layer).k[:, len(p)], rtol=1e-5, atol=1e-5
            )
