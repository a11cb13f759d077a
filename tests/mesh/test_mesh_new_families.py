"""Gemma 3, gpt-oss (MXFP4 experts) and GLM-4.5's MoE split over a 2-node mesh, and over 2 stages
of 2 lockstep ranks, equal the single process: packaged into fragments (Gemma's norms read as
1 + w once; gpt-oss's experts one fragment per chunk, kept as fp4), each stage loading only its
layers, each rank its heads and experts, the sliding windows crossing stages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from seamline.app import LocalModel
from seamline.params import SamplingParams
from seamline.server.demo import memory_cap_gb
from tests.support.family_folders import (
    CONTEXT,
    build_gemma3_folder,
    build_glm4_moe_folder,
    build_oss_folder,
)
from tests.support.mesh_harness import MeshProcesses, split_completion

PROMPT = "The rivers of Europe include the Rhine, the Danube and"


@pytest.mark.parametrize(
    "build", [build_gemma3_folder, build_oss_folder], ids=["gemma3", "gpt-oss-mxfp4"]
)
def test_a_new_family_split_over_two_nodes_matches_one_process(
    tmp_path: Path, build: Callable[[Path], Path]
) -> None:
    folder = build(tmp_path / "model")
    local = LocalModel.load(folder, context=CONTEXT)
    ids = local.codec.encode(PROMPT)
    assert len(ids) > 8  # longer than the sliding window
    expected = local.codec.decode(list(local.engine.generate(ids, SamplingParams(max_tokens=24))))
    assert split_completion(tmp_path / "mesh", folder, PROMPT, 24, CONTEXT) == expected


@pytest.mark.parametrize(
    "build",
    [build_oss_folder, build_gemma3_folder, build_glm4_moe_folder],
    ids=["gpt-oss-mxfp4", "gemma3", "glm4_moe"],
)
def test_a_new_family_over_two_stages_of_two_ranks_matches_one_process(
    tmp_path: Path, build: Callable[[Path], Path]
) -> None:
    """Stages × lockstep groups: each rank holds its experts (gpt-oss's MXFP4, GLM's routed ones
    beside the shared expert) and heads (gpt-oss's sinks, Gemma's q/k norms), rank 0 adds
    gpt-oss's attention output bias."""
    folder = build(tmp_path / "model")
    local = LocalModel.load(folder, context=CONTEXT)
    expected = local.codec.decode(
        list(local.engine.generate(local.codec.encode(PROMPT), SamplingParams(max_tokens=24)))
    )
    mesh = MeshProcesses(
        tmp_path / "mesh",
        nodes=4,
        model=str(folder),
        node_memory_gb=memory_cap_gb(str(folder), 2, CONTEXT, ranks=2),
        serve_args=("--context", str(CONTEXT), "--tensor-parallel", "2"),
    )
    try:
        mesh.start()
        stages = mesh.wait_ready()["stages"]
        assert len(stages) == 2 and all(len(s["ranks"]) == 2 for s in stages), stages
        reply = mesh.client().completions.create(
            model="default", prompt=PROMPT, temperature=0, max_tokens=24
        )
        assert reply.choices[0].text == expected
    finally:
        mesh.stop()


def test_the_real_gemma_file_split_over_two_nodes_answers_as_llama_server(tmp_path: Path) -> None:
    """The converter-written Gemma 3 270M on a 2-node mesh: its prompt gets BOS as the file says
    (the answer is llama-server's), and its token-id prompts are taken as given."""
    from seamline.server.demo import memory_cap_gb
    from tests.support.llama_cpp import gemma3_270m
    from tests.support.real_gemma import ANSWER, PROMPT, PROMPT_IDS

    model = gemma3_270m()
    mesh = MeshProcesses(
        tmp_path / "mesh",
        nodes=2,
        model=str(model),
        node_memory_gb=memory_cap_gb(str(model), 2, 512),
        serve_args=("--context", "512", "--speculative", "off"),
    )
    try:
        mesh.start()
        assert len(mesh.wait_ready()["stages"]) == 2
        client = mesh.client()
        for prompt in (PROMPT, PROMPT_IDS):
            reply = client.completions.create(
                model="default", prompt=prompt, temperature=0, max_tokens=16
            )
            assert reply.usage is not None and reply.usage.prompt_tokens == len(PROMPT_IDS)
            assert reply.choices[0].text == ANSWER
    finally:
        mesh.stop()
