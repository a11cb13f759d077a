"""A mesh computes in one precision, the coordinator's: with no flag the fast one (bfloat16
activations, int8 blocks), every stage reports it in /api/status, and a node that cannot run
it (no int8 kernels: ``SEAMLINE_QUANT_KERNELS=0`` stands in for a CPU without AVX2)
is said once and not planned, while the others serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from seamline.app import LocalModel
from seamline.quant.native import kernels
from seamline.server.demo import memory_cap_gb
from tests.support.mesh import expected_text
from tests.support.mesh_harness import MeshProcesses

CONTEXT = 1024
QUESTION = "List three prime numbers."


@pytest.mark.skipif(
    kernels() is None, reason="the int8-block kernels need x86-64 with AVX2 and a compiler"
)
def test_a_fast_mesh_plans_only_the_nodes_that_run_its_precision(tmp_path: Path) -> None:
    cap = memory_cap_gb(None, 2, CONTEXT, dtype_bytes=2)  # two stages of bfloat16 KV
    mesh = MeshProcesses(
        tmp_path,
        nodes=3,
        node_memory_gb=cap,
        serve_args=("--context", str(CONTEXT), "--precision", "fast"),
    )
    mesh.start(join=False)
    try:
        mesh.join("plain", prefix=("env", "SEAMLINE_QUANT_KERNELS=0"))
        mesh.join("node0")
        mesh.join("node1")
        status = mesh.wait_ready()
        chosen = {
            "name": "fast",
            "dtype": "bfloat16",
            "int8_activations": True,
            "label": "bfloat16+int8",
        }
        assert status["precision"] == chosen, status
        assert sorted(s["node_id"] for s in status["stages"]) == ["node0", "node1"], status[
            "stages"
        ]
        assert [s.get("precision") for s in status["stages"]] == ["bfloat16+int8"] * 2, status[
            "stages"
        ]
        said = [
            line for line in mesh.output if "node plain cannot run the int8-block matmuls" in line
        ]
        assert len(said) == 1, "".join(mesh.output[-30:])
        reply = mesh.client().chat.completions.create(
            model="default",
            temperature=0,
            max_tokens=24,
            messages=[{"role": "user", "content": QUESTION}],
        )
        # the fast path's words as this machine computes them in one process (they hang on the
        # prefill's rounding: AMX tiles, bfloat16 or float32 tiles)
        want = expected_text(LocalModel.load(precision="fast"), QUESTION, 24)
        assert reply.choices[0].message.content == want, (reply, want)
    finally:
        mesh.stop()
