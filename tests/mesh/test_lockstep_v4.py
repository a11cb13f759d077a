"""DeepSeek-V4 in lockstep groups, real processes over real sockets, against the single process.

Each rank holds whole output groups of query heads (their ``q_b`` rows, sinks, ``o_a`` rows
and ``o_b`` columns), a range of the routed experts, rows of the shared expert and rows of
the head; the shared key/value head, its compressors and the indexer are every rank's, so
every rank keeps the same caches. Greedy tokens must equal the engine's and logits stay
within 1e-4 (float32; splitting changes only the order of sums)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from seamline.app import LocalModel
from seamline.errors import RequestError
from seamline.params import SamplingParams
from seamline.runtime.engine import Engine
from seamline.server.demo import memory_cap_gb
from seamline.weights.loader import load_stage, open_source
from tests.support.lockstep_harness import (
    check_greedy_exchange,
    engine_reference,
    generate_recording,
    running_group,
)
from tests.support.mesh_harness import MeshProcesses
from tests.support.v4_folder import CONTEXT, PROMPT, build_v4_folder
from tests.support.v4_reference import save_random_v4

ATOL = 1e-4
STEPS = 24
IDS = [
    1,
    5,
    9,
    13,
    2,
    7,
    3,
    11,
    40,
    41,
    17,
    60,
    88,
    4,
]  # crosses the window and both compression rates


def test_v4_group_of_two_ranks_equals_the_engine(tmp_path: Path) -> None:
    folder = tmp_path / "v4"
    save_random_v4(folder)
    ref = engine_reference(Engine(load_stage(open_source(folder))), IDS, steps=STEPS)
    with running_group(folder, 2) as group:
        stage = group.leader.stage
        assert (
            stage.layers["1"].attn.shape.heads == 2
            and stage.layers["1"].ffn.experts_down.shape[0] == 2
        )  # type: ignore[union-attr]
        group.greedy_exchange = False
        tokens, logits = generate_recording(group, IDS, SamplingParams(max_tokens=STEPS))
        assert tokens == ref.tokens
        err = (logits - ref.logits[: len(logits)]).abs().max().item()
        assert err < ATOL, err
        group.greedy_exchange = True
        check_greedy_exchange(group, ref, ATOL)
        seq = group.create()
        group.run(seq, 0, torch.tensor(IDS))
        with pytest.raises(RequestError, match="cannot be rewound"):
            group.rewind(seq, 3)
        after = group.run(
            seq, len(IDS), torch.tensor([ref.tokens[0]])
        )  # the group stays in step after the refusal
        torch.testing.assert_close(after, ref.logits[1], rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def v4_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    folder = build_v4_folder(tmp_path_factory.mktemp("lockstep-v4") / "v4")
    local = LocalModel.load(folder, context=CONTEXT)
    ids = local.codec.encode(PROMPT)
    return folder, local.codec.decode(
        list(local.engine.generate(ids, SamplingParams(max_tokens=STEPS)))
    )


def test_v4_mesh_of_two_lockstep_stages_matches_single_process(
    tmp_path: Path, v4_text: tuple[Path, str]
) -> None:
    """2 stages x 2 ranks: the second stage's group takes the residual and the ids from the
    first (a group alone is tested above, without the mesh)."""
    folder, expected, stages = *v4_text, 2
    cap = memory_cap_gb(str(folder), stages, CONTEXT, ranks=2)
    mesh = MeshProcesses(
        tmp_path,
        nodes=2 * stages,
        model=str(folder),
        node_memory_gb=cap,
        serve_args=("--context", str(CONTEXT), "--tensor-parallel", "2"),
    )
    try:
        mesh.start()
        status = mesh.wait_ready()
        assert [len(s["ranks"]) for s in status["stages"]] == [2] * stages, status["stages"]
        body = {"model": "default", "prompt": PROMPT, "temperature": 0, "max_tokens": STEPS}
        for _ in range(2):  # caches released and made afresh, in step
            reply = httpx.post(f"{mesh.base_url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == expected
    finally:
        mesh.stop()
