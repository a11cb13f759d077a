"""Trust, checked: a member that sends READY without loading its layers fails the start-up probe,
and one that returns perturbed hidden states on live frames is found by `--verify-fraction 1`;
each is removed, the mesh serves on without it, and every client's answer is the reference's.

The mesh runs over loopback: the coordinator and two honest nodes are `seamline` processes;
the liar is a real ``Node`` run in this process (its links are real), changed as an attacker
would change it. Three equal nodes are planned as three stages; any two hold the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from seamline.app import LocalModel
from seamline.mesh.node.fetch import FetchReport
from seamline.mesh.node.process import Node, NodeOptions
from seamline.mesh.protocol.invite import Invite
from seamline.params import SamplingParams
from seamline.server.demo import memory_cap_gb
from tests.support.mesh_harness import MeshProcesses

CONTEXT = 1024
QUESTIONS = ["Name three rivers in Europe and one fact about each.", "Write a haiku about the sea."]
TOKENS = 24
LIAR = "liar0"


@pytest.fixture(scope="module")
def model() -> LocalModel:
    return LocalModel.load(context=CONTEXT)


def _expected(model: LocalModel, question: str) -> str:
    ids = model.codec.encode_chat([{"role": "user", "content": question}])
    params = SamplingParams(max_tokens=TOKENS, stop_token_ids=model.codec.stop_ids)
    return model.codec.decode(list(model.engine.generate(ids, params)))


def _ask(mesh: MeshProcesses, question: str) -> str:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": TOKENS,
    }
    reply = httpx.post(f"{mesh.base_url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def _mesh_with_liar(root: Path, tamper: Callable[[Node], None]) -> tuple[MeshProcesses, Node]:
    """A mesh planned over the liar and two honest nodes, any two of which hold the model. (All
    join before the first plan: a member removed by a check takes its invite with it, and the
    honest ones joined with the same invite.)"""
    cap = memory_cap_gb(None, 2, CONTEXT)
    mesh = MeshProcesses(
        root,
        nodes=3,
        node_memory_gb=cap,
        serve_args=("--context", str(CONTEXT), "--verify-fraction", "1"),
    ).start(join=False)
    options = NodeOptions(
        max_memory_bytes=int(cap * (1 << 30)), node_id=LIAR, cache_dir=root / LIAR, progress=False
    )
    liar = Node(Invite.decode(mesh.token), options)
    tamper(liar)
    liar.join()
    threading.Thread(target=liar.serve, daemon=True).start()
    mesh.join("node1")
    mesh.join("node2")
    return mesh, liar


def _perturbs_live_frames(node: Node) -> None:
    """Its stage computes honestly for the coordinator's start-up probe, then scales what it
    computes for live frames by 1.05: the hidden states it sends (or the logits it draws from)."""
    load = node._load
    live = threading.local()

    def tampered_load(assign: object) -> None:
        load(assign)  # type: ignore[arg-type]
        worker = node.worker
        assert worker is not None
        forward, run_batch = worker.stage.forward_batch, worker.run_batch

        def forward_batch(*args: object, **kwargs: object) -> torch.Tensor:
            out = forward(*args, **kwargs)  # type: ignore[operator]
            return out * 1.05 if getattr(live, "on", False) else out

        def live_batch(work: list) -> list:
            live.on = True
            try:
                return run_batch(work)
            finally:
                live.on = False

        worker.stage.forward_batch = forward_batch  # type: ignore[method-assign]
        worker.run_batch = live_batch  # type: ignore[method-assign]

    node._load = tampered_load  # type: ignore[method-assign]


def _loads_nothing(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """It takes its assignment, allocates its layers' shapes without reading a weight (it
    knows the model's shapes), and reports READY as if it had loaded them."""
    from seamline.app import default_model_path
    from seamline.config import ModelConfig
    from seamline.mesh.node import loading
    from seamline.ownership import Ownership
    from seamline.weights.loader import build_stage, open_source

    config = ModelConfig.from_hf_dict(open_source(default_model_path()).config_dict())

    def fake_load(invite: object, assign: object, *rest: object) -> tuple[object, FetchReport]:
        stage = build_stage(config, Ownership(layers=tuple(assign.layers)))  # type: ignore[attr-defined]
        return stage.to_empty(device="cpu"), FetchReport()  # memory as it was left: no weight read

    monkeypatch.setattr(loading, "load_assignment", fake_load)


def _removed(mesh: MeshProcesses, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = mesh.status()
        if LIAR in status["verification"]["expelled"] and status["ready"]:
            return dict(status)
        time.sleep(0.5)
    raise AssertionError(f"the liar was not removed: {mesh.status_or_output()}")


def test_a_member_that_reports_ready_without_loading_fails_the_start_up_check(
    tmp_path: Path, model: LocalModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh, _ = _mesh_with_liar(tmp_path, lambda node: _loads_nothing(node, monkeypatch))
    try:
        status = _removed(mesh)
        assert LIAR not in {n for s in status["stages"] for n in s["ranks"]}
        assert LIAR not in {n["node_id"] for n in status["nodes"]}
        for question in QUESTIONS:
            assert _ask(mesh, question) == _expected(model, question)
        assert "failed the start-up check" in "\n".join(mesh.output)
    finally:
        mesh.stop()


def test_a_member_that_perturbs_live_frames_is_found_and_no_client_sees_its_tokens(
    tmp_path: Path, model: LocalModel
) -> None:
    mesh, liar = _mesh_with_liar(tmp_path, _perturbs_live_frames)
    try:
        first = mesh.wait_ready()
        assert LIAR in {
            n for s in first["stages"] for n in s["ranks"]
        }  # it passed the start-up probe
        answers = {}
        threads = [
            threading.Thread(target=lambda q=q: answers.__setitem__(q, _ask(mesh, q)))
            for q in QUESTIONS
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert answers == {q: _expected(model, q) for q in QUESTIONS}
        status = _removed(mesh)
        assert status["verification"]["violations"] >= 1 and LIAR not in {
            n["node_id"] for n in status["nodes"]
        }
        assert _ask(mesh, QUESTIONS[0]) == _expected(model, QUESTIONS[0])
    finally:
        mesh.stop()
