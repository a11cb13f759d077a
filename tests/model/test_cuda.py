"""On a CUDA GPU (skipped with the reason where there is none): a stage on the GPU gives the CPU
exact path's answers. Float32 activations both sides; the GPU sums in another order (Triton's
kernels, cuBLAS without TF32), so logits agree within ``LOGIT_TOLERANCE`` of their scale and
the greedy tokens are the same.

Where the 98 MB embedded file is not installed (a device machine gets the project's files
only), its stand-in is random weights of its shapes and types (``bench.gpu_models``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.app import LocalModel
from seamline.model.devices import place_stage
from seamline.params import SamplingParams
from seamline.runtime.engine import Engine
from seamline.weights.loader import load_stage, open_source
from tests.support.configs import checkpoint_folder, dense_configs
from tests.support.cuda import embedded_or_standin
from tests.support.reference import save_random_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)"
)
LOGIT_TOLERANCE = 2e-4  # of the largest logit's magnitude
TOKENS = 32
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    diff = (got.float().cpu() - want.float()).abs().max().item()
    assert diff <= LOGIT_TOLERANCE * max(scale, 1.0), (
        f"max |diff| {diff:.3g} against logits up to {scale:.3g}"
    )


def _greedy(model: LocalModel, prompt: list[int]) -> list[int]:
    return list(
        model.engine.generate(prompt, SamplingParams(max_tokens=TOKENS))
    )  # no stop tokens: all 32


def test_the_embedded_model_on_cuda_gives_the_cpu_exact_path() -> None:
    path = embedded_or_standin()
    cpu = LocalModel.load(path, precision="exact", device="cpu")
    gpu = LocalModel.load(path, precision="exact", device="cuda")
    prompt = cpu.codec.encode_chat([{"role": "user", "content": PROMPT}])
    ids = torch.tensor(prompt)
    want = cpu.engine.stage.forward(ids, 0, cpu.engine.stage.new_cache())
    got = gpu.engine.stage.forward(ids, 0, gpu.engine.stage.new_cache())
    assert got.device.type == "cuda"
    _assert_close(got, want)
    assert _greedy(gpu, prompt) == _greedy(cpu, prompt)


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_a_moe_model_on_cuda_gives_the_cpu_path(kind: str, tmp_path: Path) -> None:
    source = open_source(checkpoint_folder(kind, tmp_path))  # float32 weights: no tokenizer needed
    cpu = Engine(load_stage(source, dtype=torch.float32, device=torch.device("cpu")))
    gpu = Engine(load_stage(source, dtype=torch.float32, device=torch.device("cuda")))
    ids = torch.arange(3, 40) % cpu.stage.config.vocab_size
    want = cpu.stage.forward(ids, 0, cpu.stage.new_cache())
    got = gpu.stage.forward(ids, 0, gpu.stage.new_cache())
    _assert_close(got, want)
    greedy = SamplingParams(max_tokens=TOKENS)
    assert list(gpu.generate(ids.tolist(), greedy)) == list(cpu.generate(ids.tolist(), greedy))


def test_a_stage_spanning_the_gpu_and_the_cpu_gives_the_cpu_path(tmp_path: Path) -> None:
    save_random_model(dense_configs()["qwen2"], tmp_path)
    source = open_source(tmp_path)
    cpu = load_stage(source, dtype=torch.float32)
    spanned = load_stage(source, dtype=torch.float32)
    place_stage(spanned, torch.device("cuda"), gpu_layers=1)
    ids = torch.arange(1, 30)
    want = cpu.forward(ids, 0, cpu.new_cache())
    cache = spanned.new_cache()
    got = spanned.forward(
        ids[:20], 0, cache
    )  # a prompt, then decode rows: the caches live per device
    _assert_close(got, want[:20])
    for position in range(20, 29):
        _assert_close(
            spanned.forward(ids[position : position + 1], position, cache),
            want[position : position + 1],
        )


def test_decode_steps_replayed_as_cuda_graphs_give_the_eager_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Graphs of 1 row and of 4 (three sequences and a padding row) against eager steps."""
    from seamline.runtime import cuda_graphs
    from seamline.runtime.core import EngineCore, LocalExecutor
    from seamline.runtime.scheduler import Scheduler

    model = LocalModel.load(embedded_or_standin(), precision="exact", device="cuda")
    stage = model.engine.stage
    assert cuda_graphs.GraphedDecode.fits(stage)
    prompts = [
        model.codec.encode_chat([{"role": "user", "content": text}])
        for text in (PROMPT, "Hi!", "Count to ten.")
    ]

    def answers(graphs: bool) -> tuple[list[list[int]], cuda_graphs.GraphedDecode | None]:
        executor = LocalExecutor(stage, 4096)
        executor.graphs = executor.graphs if graphs else None
        core = EngineCore(Scheduler(stage, 4096), executor)
        sequences = [core.scheduler.add(p, SamplingParams(max_tokens=TOKENS)) for p in prompts]
        while not all(s.finished for s in sequences):
            core.step()
        return [s.tokens for s in sequences], executor.graphs

    eager, _ = answers(graphs=False)
    replayed, graphs = answers(graphs=True)
    assert graphs is not None and set(graphs.captured) >= {4} and not graphs.failed
    assert replayed == eager
    assert _greedy(model, prompts[1]) == eager[1]  # one sequence alone: the 1-row graph
