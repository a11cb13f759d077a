"""Trust, checked: a member that sends READY without loading its layers fails the start-up probe,
and one that returns perturbed hidden states on live frames is found by `--verify-fraction 1`
when its stage is the one checked (``--verify-node``, the tests' seam: each followed request
checks one stage); each is removed, the mesh serves on without it, and every client's answer is the reference's.
An honest mesh at the default precision (int8 blocks, every row computed as alone) passes its
checks under load.

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
from seamline.precision import int8_kernels_here
from seamline.runtime import digest
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
    mesh = _checked_mesh(root, "--verify-node", LIAR)  # its stage is the one checked
    liar = _node_in_this_process(mesh, root, LIAR, tamper)
    mesh.join("node1")
    mesh.join("node2")
    return mesh, liar


def _checked_mesh(root: Path, *serve_args: str) -> MeshProcesses:
    """A coordinator that checks every request (one stage of each, on its own copy of that
    stage's layers), its nodes on caps under which any two hold the model; none joined yet."""
    return MeshProcesses(
        root,
        nodes=3,
        node_memory_gb=memory_cap_gb(None, 2, CONTEXT),
        serve_args=("--context", str(CONTEXT), "--verify-fraction", "1", *serve_args),
    ).start(join=False)


def _node_in_this_process(
    mesh: MeshProcesses, root: Path, name: str, tamper: Callable[[Node], None]
) -> Node:
    """A real node run in this process, changed by ``tamper`` before it joins with the mesh's
    own invite (its links are real)."""
    options = NodeOptions(
        max_memory_bytes=int(memory_cap_gb(None, 2, CONTEXT) * (1 << 30)),
        node_id=name,
        cache_dir=root / name,
        progress=False,
    )
    node = Node(Invite.decode(mesh.token), options)
    tamper(node)
    node.join()
    threading.Thread(target=node.serve, daemon=True).start()
    return node


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


def _removed(mesh: MeshProcesses, liar: str = LIAR, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = mesh.status()
        if liar in status["verification"]["expelled"] and status["ready"]:
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
        _lets_go_of_checked_layers(mesh)
    finally:
        mesh.stop()


def _lets_go_of_checked_layers(mesh: MeshProcesses, timeout_s: float = 30) -> None:
    """With no request in flight, the coordinator holds none of the model's layers."""
    deadline = time.monotonic() + timeout_s
    while mesh.status()["verification"]["checking"]:
        assert time.monotonic() < deadline, mesh.status()["verification"]
        time.sleep(0.5)


def _sends_other_than_it_computes(node: Node, armed: threading.Event, signs: list[str]) -> None:
    """Once armed, its stage computes and reports honestly, and every frame it sends downstream
    carries its rows scaled by 1.05. ``signs[i]`` says how its i-th such frame is signed (the
    last one for the rest): "honest", as the honest frame (its bytes do not hash as signed: the
    receiver refuses it and can show nothing); "digests", the altered bytes with the honest
    digests (the receiver shows the coordinator a lie signed by the liar); "altered", the
    altered bytes with their digests (a lie the coordinator's check of its layers shows)."""
    route = node._route
    sent = [0]

    def tampered_route(message: object) -> None:
        route(message)  # type: ignore[arg-type]
        worker = node.worker
        assert worker is not None
        downstream, seed = worker.links.downstream, worker.digest_seed

        def send(rows: list, out: torch.Tensor, ids: object, signed: object) -> None:
            assert downstream is not None
            if not armed.is_set():
                return downstream(rows, out, ids, signed)  # type: ignore[arg-type]
            bad = out * 1.05
            how = signs[min(sent[0], len(signs) - 1)]
            sent[0] += 1
            if how != "honest" and worker.links.sign is not None:
                said = bad if how == "altered" else out
                starts = [sum(r.count for r in rows[:i]) for i in range(len(rows))]
                digests = [
                    digest.digest(said[at : at + r.count], r.position, seed)
                    for at, r in zip(starts, rows)
                ]
                keys = [(r.request, r.position, r.count) for r in rows]
                signed = worker.links.sign(keys, torch.stack(digests), bad)
            downstream(rows, bad, ids, signed)  # type: ignore[arg-type]

        if downstream is not None:
            worker.links.downstream = send

    node._route = tampered_route  # type: ignore[method-assign]


def _mesh_with_two_would_be_liars(
    root: Path, signs: list[str]
) -> tuple[MeshProcesses, dict[str, threading.Event]]:
    """Two members in this process, each of which lies when armed, and one `seamline` process,
    all joined with one invite."""
    mesh = _checked_mesh(root)
    armed = {name: threading.Event() for name in ("node_a", "node_b")}
    for name, event in armed.items():
        _node_in_this_process(
            mesh, root, name, lambda node, e=event: _sends_other_than_it_computes(node, e, signs)
        )
    mesh.join("node1")
    return mesh, armed


def _arm_one_before_the_last_stage(mesh: MeshProcesses, armed: dict[str, threading.Event]) -> str:
    order = [s["ranks"][0] for s in mesh.wait_ready()["stages"]]
    liar = next(name for name in order[:-1] if name in armed)
    armed[liar].set()
    return liar


def _only_the_liar_removed(mesh: MeshProcesses, liar: str, model: LocalModel) -> str:
    """Asserts the liar alone was removed, and the mesh answers right after; the log."""
    status = _removed(mesh, liar)
    assert status["verification"]["expelled"] == [liar]
    members = {n["node_id"] for n in status["nodes"]}
    assert members == {"node_a", "node_b", "node1"} - {liar}
    assert _ask(mesh, QUESTIONS[1]) == _expected(model, QUESTIONS[1])
    return "".join(mesh.output)


def test_a_member_that_sends_other_than_it_computes_is_removed_and_its_neighbour_kept(
    tmp_path: Path, model: LocalModel
) -> None:
    """The first in-process member planned before the last stage turns liar. Its neighbour
    reports what it took with the liar's signature, which blames the liar alone; removing it
    removes no one else."""
    mesh, armed = _mesh_with_two_would_be_liars(tmp_path, ["honest", "honest", "altered"])
    try:
        liar = _arm_one_before_the_last_stage(mesh, armed)
        for question in QUESTIONS:
            assert _ask(mesh, question) == _expected(model, question)
        log = _only_the_liar_removed(mesh, liar, model)
        assert "signed and sent a frame other than what its layers compute" in log, log
        assert "refused a frame" in log  # its honestly signed, altered frames
    finally:
        mesh.stop()


def test_a_member_that_signs_honest_digests_for_altered_bytes_is_shown_and_removed(
    tmp_path: Path, model: LocalModel
) -> None:
    """The liar signs the hashes of the bytes it sends with the digests of the honest rows: its
    neighbour refuses the frame and shows the coordinator the row with the liar's signature,
    which proves the lie without the neighbour's word; the liar alone is removed."""
    mesh, armed = _mesh_with_two_would_be_liars(tmp_path, ["digests"])
    try:
        liar = _arm_one_before_the_last_stage(mesh, armed)
        for question in QUESTIONS:
            assert _ask(mesh, question) == _expected(model, question)
        log = _only_the_liar_removed(mesh, liar, model)
        assert "signed a digest its rows' bytes do not make" in log, log  # the refusal
        assert f"verification: {liar}: it signed a digest other than the bytes" in log, log
    finally:
        mesh.stop()


@pytest.mark.skipif(not int8_kernels_here(), reason="int8-block kernels need AVX-512 VNNI")
def test_an_honest_mesh_at_the_default_precision_passes_its_checks_under_load(
    tmp_path: Path,
) -> None:
    """int8 blocks, every request checked: many prompts at once, sharing the chat template's
    prefix (forks of one another's caches) and batched past the int8 kernels' rows, are the
    reference's, so no honest member is removed at the tight tolerance."""
    mesh = MeshProcesses(
        tmp_path,
        nodes=2,
        node_memory_gb=memory_cap_gb(None, 2, CONTEXT, dtype_bytes=2),
        serve_args=("--context", str(CONTEXT), "--verify-fraction", "1", "--precision", "fast"),
    ).start()
    try:
        assert mesh.wait_ready()["precision"]["int8_activations"]
        questions = [f"Tell me a story about the number {i} and why it matters." for i in range(12)]
        threads = [threading.Thread(target=_ask, args=(mesh, q)) for q in questions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        checks = mesh.status()["verification"]
        assert checks["checked_tokens"] > 0, checks
        assert (checks["violations"], checks["expelled"]) == (0, []), mesh.status_or_output()
    finally:
        mesh.stop()
