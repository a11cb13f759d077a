"""A mesh of one CPU node and one GPU node (`seamline join --device cpu` / `--device cuda`) gives
the single process's text (skipped with the reason where torch sees no CUDA device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.app import LocalModel
from seamline.server.demo import memory_cap_gb
from seamline_bench.gpu import half_node_cap_gb
from tests.support.cuda import embedded_or_standin
from tests.support.mesh import QUESTION, ask, expected_text
from tests.support.mesh_harness import MeshProcesses

TOKENS = 24


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")
def test_a_cpu_stage_and_a_gpu_stage_give_the_single_process_text(tmp_path: Path) -> None:
    model = embedded_or_standin()
    want = expected_text(LocalModel.load(model, precision="exact"), QUESTION, TOKENS)
    cap = memory_cap_gb(str(model), 2, 1024, within=0.5)
    mesh = MeshProcesses(
        tmp_path, nodes=2, node_memory_gb=cap, model=str(model), serve_args=("--context", "1024")
    )
    try:
        mesh.start(join=False)
        mesh.join("node0", extra=("--device", "cpu"))
        # its GPU and its memory together hold what the CPU node holds, so the planner needs both
        # nodes (a whole GPU would take every layer)
        mesh.join("node1", extra=("--device", "cuda", "--max-memory", str(half_node_cap_gb(cap))))
        status = mesh.wait_ready()
        assert [s["node_id"] for s in status["stages"]] == ["node0", "node1"] or [
            s["node_id"] for s in status["stages"]
        ] == ["node1", "node0"], status
        assert {s["device"] for s in status["stages"]} & {"cuda", "cuda:0"}, status
        assert ask(mesh, QUESTION, TOKENS)["choices"][0]["message"]["content"] == want
    finally:
        mesh.stop()
