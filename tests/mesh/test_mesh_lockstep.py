"""Lockstep groups inside the mesh: `seamline serve --tensor-parallel N` with ranks joined by token.

Real processes over real sockets: a coordinator and `seamline join` nodes on loopback. A stage
that is a lockstep group must answer exactly as the single process does (greedy text equal),
alone (1 stage x 2 ranks) and in a pipeline (2 stages x 2 ranks, where the groups also verify
stage 0's speculative windows); a rank killed or stopped
mid-answer, with no node to take its place, ends the request with a clear error at the replay
deadline instead of a hang (with a standby: test_mesh_lockstep_heal.py).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from seamline.app import LocalModel
from seamline.params import SamplingParams
from seamline.runtime.step_probe import PROBE_ROWS, PROMPT_ROWS
from seamline.server.demo import memory_cap_gb
from tests.support.mesh_harness import MeshProcesses, at_once
from tests.support.moe_folder import CONTEXT, PROMPT, build_moe_folder

TOKENS = 24

PROBED = {str(rows) for rows in PROBE_ROWS}  # a stage's speed probe: rows -> ms


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe_folder(tmp_path_factory.mktemp("lockstep-moe") / "moe")


@pytest.fixture(scope="module")
def expected(moe_folder: Path) -> str:
    local = LocalModel.load(moe_folder, context=CONTEXT)
    ids = local.codec.encode(PROMPT)
    return local.codec.decode(list(local.engine.generate(ids, SamplingParams(max_tokens=TOKENS))))


def _complete(mesh: MeshProcesses) -> str:
    reply = mesh.client().completions.create(
        model="default", prompt=PROMPT, temperature=0, max_tokens=TOKENS
    )
    return reply.choices[0].text


def _mesh(
    root: Path, folder: Path, nodes: int, cap_gb: float | None = None, transport: str = "tcp"
) -> MeshProcesses:
    return MeshProcesses(
        root,
        nodes=nodes,
        model=str(folder),
        node_memory_gb=cap_gb,
        serve_args=(
            "--context",
            str(CONTEXT),
            "--tensor-parallel",
            "2",
            "--transport",
            transport,
            "--replay-deadline",
            "3",
        ),
    )


@pytest.mark.parametrize("transport", ["tcp", "torch"])
def test_one_stage_of_two_ranks_matches_single_process(
    tmp_path: Path, moe_folder: Path, expected: str, transport: str
) -> None:
    mesh = _mesh(tmp_path, moe_folder, nodes=2, transport=transport)
    try:
        mesh.start()
        status = mesh.wait_ready()
        assert [sorted(s["ranks"]) for s in status["stages"]] == [["node0", "node1"]]
        assert _complete(mesh) == expected
        assert _complete(mesh) == expected  # caches were released and made afresh, in step
    finally:
        mesh.stop()


def test_two_stages_of_two_ranks_match_single_process(
    tmp_path: Path, moe_folder: Path, expected: str
) -> None:
    cap = memory_cap_gb(str(moe_folder), 2, CONTEXT, ranks=2)
    mesh = _mesh(tmp_path, moe_folder, nodes=4, cap_gb=cap)
    try:
        mesh.start()
        status = mesh.wait_ready()
        stages = status["stages"]
        assert len(stages) == 2 and all(len(s["ranks"]) == 2 for s in stages), stages
        assert sorted(r for s in stages for r in s["ranks"]) == [f"node{i}" for i in range(4)]
        assert _complete(mesh) == expected
        _check_concurrent(mesh, moe_folder)
        _check_speculation(mesh, moe_folder)
        _check_downloads(mesh, status)
        _check_probes(mesh)
        _kill_mid_answer(mesh, stages[1]["ranks"][1])  # the second stage's follower: no hang either
    finally:
        mesh.stop()


def _check_concurrent(mesh: MeshProcesses, folder: Path) -> None:
    """Three clients at once, prompts of different lengths: their rows run as BATCH commands
    of both groups, and each gets the text it gets alone on one process (greedy)."""
    local = LocalModel.load(folder, context=CONTEXT)
    prompts = [PROMPT, PROMPT + " and then some more words", "Short"]

    def ask(i: int) -> str:
        reply = mesh.client().completions.create(
            model="default", prompt=prompts[i], temperature=0, max_tokens=12 + i
        )
        return str(reply.choices[0].text)

    answers = at_once(ask, len(prompts))
    for i, prompt in enumerate(prompts):
        ids = local.codec.encode(prompt)
        alone = local.codec.decode(
            list(local.engine.generate(ids, SamplingParams(max_tokens=12 + i)))
        )
        assert answers.get(i) == alone, prompt


def _check_speculation(mesh: MeshProcesses, folder: Path) -> None:
    """A longer greedy answer, which this random model fills with repeats: stage 0 drafts them,
    both groups verify the windows (flagged in their BATCH commands), and the text is the one
    process's without drafts."""
    local = LocalModel.load(folder, context=CONTEXT)
    alone = local.codec.decode(
        list(local.engine.generate(local.codec.encode(PROMPT), SamplingParams(max_tokens=64)))
    )
    reply = mesh.client().completions.create(
        model="default", prompt=PROMPT, temperature=0, max_tokens=64
    )
    assert reply.choices[0].text == alone
    counts = (
        httpx.get(f"{mesh.base_url}/api/status", timeout=30).json()["stages"][0].get("speculation")
        or {}
    )
    assert counts.get("windows", 0) > 0 and counts["accepted"] > 0, counts


def _check_probes(mesh: MeshProcesses) -> None:
    """Each group's leader probed steps through its whole group once idle after it was linked
    (``mesh.node.idle_probe``), and measured its steps outside their forwards while it served."""
    deadline = time.monotonic() + 60
    while True:
        stages = httpx.get(f"{mesh.base_url}/api/status", timeout=30).json()["stages"]
        if all(s.get("step_probe_ms") for s in stages) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for stage in stages:
        probed = stage["step_probe_ms"]
        assert set(probed) == PROBED and all(ms > 0 for ms in probed.values()), stage
        prompts = stage["prompt_probe_ms"]
        assert {int(rows) for rows in prompts} == set(PROMPT_ROWS) and all(
            ms > 0 for ms in prompts.values()
        ), stage
        assert stage["step_overhead_ms"]["1"] > 0, stage


def _check_downloads(mesh: MeshProcesses, status: dict) -> None:
    """Each rank downloaded its stage's fragments but only its own routed experts' chunks."""
    from seamline.config import ModelConfig
    from seamline.ownership import rank_ownership
    from seamline.weights.fragments import Manifest, fragments_for

    manifest = Manifest.load(
        next((mesh.root / "coordinator" / "packages").glob("*/manifest.json")).parent
    )
    config = ModelConfig.from_hf_dict(manifest.config)
    downloaded = {n["node_id"]: n["bytes_downloaded"] for n in status["nodes"]}
    for stage in status["stages"]:
        layers, world = tuple(stage["layers"]), len(stage["ranks"])
        whole = sum(
            e.bytes for e in fragments_for(manifest, layers, stage["embedding"], stage["head"])
        )
        for rank, node in enumerate(stage["ranks"]):
            experts = rank_ownership(config, rank, world).experts
            entries = fragments_for(manifest, layers, stage["embedding"], stage["head"], experts)
            assert downloaded[node] == sum(e.bytes for e in entries) < whole, (
                node,
                downloaded[node],
                whole,
            )


def _kill_mid_answer(mesh: MeshProcesses, node_id: str) -> None:
    """Kill ``node_id`` while an answer streams: the request ends with an error naming it."""
    message = mesh.kill_mid_stream(mesh.node_procs[int(node_id.removeprefix("node"))])
    assert node_id in message and ("left the mesh" in message or "lockstep" in message), message
    assert httpx.get(f"{mesh.base_url}/health", timeout=10).status_code == 503


def test_a_silent_rank_is_lost_by_its_missed_heartbeats(tmp_path: Path, moe_folder: Path) -> None:
    """A rank that stops answering (SIGSTOP: its sockets stay open), its gate timeout set long:
    the coordinator's heartbeats (missed for 3 s) take its node for lost; its requests wait to
    replay, and with no spare node fail at the replay deadline. (Caught by a gate timeout
    instead, with a standby: test_mesh_lockstep_heal.py.)"""
    mesh = MeshProcesses(
        tmp_path,
        nodes=2,
        model=str(moe_folder),
        serve_args=(
            "--context",
            str(CONTEXT),
            "--tensor-parallel",
            "2",
            "--gate-timeout",
            "60",
            "--heartbeat-timeout",
            "3",
            "--replay-deadline",
            "2",
        ),
    )
    try:
        mesh.start()
        status = mesh.wait_ready()
        follower = status["stages"][0]["ranks"][1]
        proc = mesh.node_procs[int(follower.removeprefix("node"))]
        proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(openai.APIError) as error:
            mesh.client(timeout=60).completions.create(
                model="default", prompt=PROMPT, temperature=0, max_tokens=8
            )
        message = str(error.value)
        assert (
            f"{follower} left the mesh" in message and "could not serve again within 2 s" in message
        ), message
        assert follower not in [n["node_id"] for n in mesh.status()["nodes"]]
        assert time.monotonic() - started < 30
    finally:
        if mesh.node_procs:
            for p in mesh.node_procs:
                p.send_signal(signal.SIGCONT)
        mesh.stop()
