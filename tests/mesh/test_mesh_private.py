"""Private prompts (`seamline serve --private`): the route begins and ends on the coordinator's
own node (embedding and first layers, last layers, head and sampling), the members hold the
layers between, and nothing a member receives holds a token id of the prompt or the answer: no
prompt, no sampling parameter, frames without ids, prefix hashes it cannot undo. No member is
served the embedding or head fragments. The answers are the single process's.

Real processes over loopback: the coordinator and its own node are `seamline serve`; the two
members are real ``Node`` objects run in this process, so that everything they receive, on
their control link and their data links, is recorded as they decode it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from seamline.app import LocalModel
from seamline.mesh.node.process import Node, NodeOptions
from seamline.mesh.protocol.invite import Invite
from seamline.net.frames import EMPTY_HASH, HiddenFrame, TokenFrame, prefix_hash
from seamline.net.messages import Assign, Message, Open, Prompt
from seamline.params import SamplingParams
from seamline.weights.fragments import Manifest
from tests.support.mesh_harness import MeshProcesses

CONTEXT = 1024
QUESTION = "My bank PIN is 4921. Which rivers flow through Paris?"
TOKENS = 24
MEMBERS = ("member0", "member1")


@dataclass
class Member:
    node: Node
    received: list[object] = field(default_factory=list)  # every message and frame, as decoded
    assigns: list[Assign] = field(default_factory=list)


@dataclass
class Private:
    mesh: MeshProcesses
    members: list[Member]


@pytest.fixture(scope="module")
def model() -> LocalModel:
    return LocalModel.load(context=CONTEXT)


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Private]:
    root = tmp_path_factory.mktemp("private")
    mesh = MeshProcesses(root, nodes=3, serve_args=("--context", str(CONTEXT), "--private"))
    mesh.start(join=False, local_node=True)
    try:
        members = [_member(mesh, name, root) for name in MEMBERS]
        mesh.wait_ready()
        yield Private(mesh, members)
    finally:
        mesh.stop()


def _member(mesh: MeshProcesses, node_id: str, root: object) -> Member:
    node = Node(
        Invite.decode(mesh.token),
        NodeOptions(node_id=node_id, cache_dir=root / node_id, progress=False),
    )  # type: ignore[operator]
    member = Member(node)
    on_control, on_frame = node._on_control, node._on_frame

    def control(message: Message) -> None:
        member.received.append(message)
        if isinstance(message, Assign):
            member.assigns.append(message)
        on_control(message)

    def frame(incoming: object, peer: str, role: str) -> None:
        member.received.append(incoming)
        on_frame(incoming, peer, role)

    node._on_control, node._on_frame = control, frame  # type: ignore[method-assign]
    node.join()
    threading.Thread(target=node.serve, daemon=True).start()
    return member


def _ask(mesh: MeshProcesses, **sampling: object) -> str:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": TOKENS,
        **sampling,
    }
    reply = httpx.post(f"{mesh.base_url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def _expected(model: LocalModel, params: SamplingParams) -> str:
    ids = model.codec.encode_chat([{"role": "user", "content": QUESTION}])
    return model.codec.decode(list(model.engine.generate(ids, params)))


def test_the_ends_are_the_coordinators_own_node_and_answers_are_the_single_processs(
    private: Private, model: LocalModel
) -> None:
    stages = private.mesh.status()["stages"]
    assert stages[0]["node_id"] == stages[-1]["node_id"] == "local"
    assert stages[0]["embedding"] and stages[-1]["head"] and len(stages) >= 3
    assert {s["node_id"] for s in stages[1:-1]} <= set(MEMBERS)
    stop = model.codec.stop_ids
    assert _ask(private.mesh, temperature=0) == _expected(
        model, SamplingParams(max_tokens=TOKENS, stop_token_ids=stop)
    )
    bias = model.codec.encode_chat([{"role": "user", "content": "Seine"}])[-3]
    asked = _ask(private.mesh, temperature=0, presence_penalty=1.5, logit_bias={str(bias): 5})
    params = SamplingParams(
        max_tokens=TOKENS, stop_token_ids=stop, presence_penalty=1.5, logit_bias=((bias, 5.0),)
    )
    assert asked == _expected(
        model, params
    )  # the last stage drew with the request's own parameters


def test_no_member_receives_a_token_id_of_the_prompt_or_the_answer(
    private: Private, model: LocalModel
) -> None:
    _ask(private.mesh, temperature=0, logit_bias={"1234": 3}, stop=["zebra"])
    prompt = model.codec.encode_chat([{"role": "user", "content": QUESTION}])
    fnv = {prefix_hash(EMPTY_HASH, prompt[:n]) for n in range(1, len(prompt) + 1)}
    seen_rows = 0
    for member in private.members:
        for item in member.received:
            assert not isinstance(item, (Prompt, TokenFrame)), item
            if isinstance(item, Open):
                assert item.sampling == SamplingParams(), item  # no bias, stop ids, grammar or seed
            if isinstance(item, HiddenFrame):
                assert item.ids is None
                seen_rows += len(item.rows)
                assert not {h for r in item.rows for h in (r.hash_before, r.hash_after)} & fnv
            if isinstance(item, Message):
                text = json.dumps(item.model_dump(mode="json"))
                assert ", ".join(map(str, prompt[5:11])) not in text.replace("[", "").replace(
                    "]", ""
                )
    assert seen_rows > 0  # the members did carry the requests


def test_no_member_is_served_the_embedding_or_the_head(private: Private) -> None:
    member = private.members[0]
    assign = member.assigns[-1]
    identity = member.node.credentials.identity  # type: ignore[union-attr]
    manifest = Manifest.from_json(
        _get(assign.fragments_url, "manifest.json", identity, assign.fragments_token).json()
    )
    kept = [f for f in manifest.fragments if f.kind in ("embed", "head")]
    layer = next(f for f in manifest.fragments if f.layer == assign.layers[0])
    assert kept and all(
        _get(assign.fragments_url, f.sha256, identity, assign.fragments_token).status_code == 403
        for f in kept
    )
    assert (
        _get(assign.fragments_url, layer.sha256, identity, assign.fragments_token).status_code
        == 200
    )
    assert all(
        len(a.fragment_peers) <= len(MEMBERS) - 1 for a in member.assigns
    )  # the other member, not the ends


def _get(base: str, name: str, identity: object, token: str) -> httpx.Response:
    return httpx.get(
        f"{base}/fragments/{name}",
        verify=identity.client_context(),  # type: ignore[attr-defined]
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
