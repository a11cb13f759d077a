"""A member holds only its stage: its control link speaks for no other node's tokens or requests,
takes only the small messages members send, a node id cannot forge a log line, and a removed
member's certificate is refused by every peer the moment `seamline node remove` returns.

One mesh over loopback: the coordinator and node1 are `seamline` processes; member0 is a real
``Node`` run in this process, so the test knows the request ids it is sent (a member of the
route sees them) and holds its certificate after it is removed. Other members are played by
the test: enrolled with the invite over TLS, attached under their own certificates.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest

from seamline.mesh.control.joining import MEMBER_LIMITS
from seamline.mesh.identity import Identity, key_pem, new_key, signing_request
from seamline.mesh.node.process import Node, NodeOptions
from seamline.mesh.protocol.invite import Invite, proof
from seamline.net.frames import EMPTY_HASH, HEADER, FrameType, RowFlag, TokenRow, header
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import (
    MAX_REASON,
    PROTOCOL_VERSION,
    Assign,
    Attach,
    Attached,
    Challenge,
    Descriptor,
    Failure,
    Heartbeat,
    Join,
    Linked,
    Loading,
    Open,
    PeerLink,
    Ping,
    Pong,
    ProbeHello,
    Ready,
    Refuse,
    Renew,
    Resources,
    SpeedReady,
    SpeedSums,
    Stats,
    Welcome,
    encode_message,
)
from seamline.net.tls import TlsRefused
from seamline.server.demo import memory_cap_gb
from tests.support.mesh_harness import MeshProcesses, join_once, seamline_cmd
from tests.support.tls_peers import member, tls_link

CONTEXT = 1024
QUESTION = "Name three rivers in Europe and one fact about each."
MEMBER = "member0"  # the member run in this process


@dataclass
class Members:
    mesh: MeshProcesses
    node: Node  # member0
    opened: queue.Queue[int]  # requests opened on member0's stage, as they came
    assigns: list[Assign]  # member0's assignments


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Members]:
    root = tmp_path_factory.mktemp("members")
    cap = memory_cap_gb(None, 2, CONTEXT)
    mesh = MeshProcesses(
        root, nodes=2, node_memory_gb=cap, serve_args=("--context", str(CONTEXT))
    ).start(join=False)
    try:
        mesh.join("node1")
        options = NodeOptions(
            max_memory_bytes=int(cap * (1 << 30)),
            node_id=MEMBER,
            cache_dir=root / MEMBER,
            progress=False,
        )
        node = Node(Invite.decode(mesh.token), options)
        watched = _watch(mesh, node)
        node.join()
        threading.Thread(target=node.serve, daemon=True).start()
        assert len(mesh.wait_ready()["stages"]) == 2
        yield watched
    finally:
        mesh.stop()


def _watch(mesh: MeshProcesses, node: Node) -> Members:
    """member0, with what it is sent recorded on the way in (the Open of a request comes to
    stage 0 on the control link, to a later stage on its data link)."""
    watched = Members(mesh, node, queue.Queue(), [])
    on_control, on_frame = node._on_control, node._on_frame

    def control(message: object) -> None:
        if isinstance(message, Open):
            watched.opened.put(message.request)
        elif isinstance(message, Assign):
            watched.assigns.append(message)
        on_control(message)  # type: ignore[arg-type]

    def frame(incoming: object, peer: str, role: str) -> None:
        if isinstance(incoming, Open):
            watched.opened.put(incoming.request)
        on_frame(incoming, peer, role)

    node._on_control, node._on_frame = control, frame  # type: ignore[method-assign]
    return watched


def attached(mesh: MeshProcesses, node_id: str) -> Link:
    """A member played by the test: it proves the mesh's invite, gets a certificate for
    ``node_id`` and attaches its control link under it (it answers no speed probe, so it is
    never planned)."""
    invite, key = Invite.decode(mesh.token), new_key()
    address = ("127.0.0.1", mesh.control_port)
    with tls_link(address) as link:
        challenge = link.recv(deadline_s=10)
        assert isinstance(challenge, Challenge)
        link.send_message(_join(invite, challenge.nonce, node_id, signing_request(key, node_id)))
        welcome = link.recv(deadline_s=10)
        assert isinstance(welcome, Welcome), welcome
    identity = Identity(
        node_id, key_pem(key).decode(), welcome.certificate, challenge.ca_certificate
    )
    control = tls_link(address, identity)
    assert isinstance(control.recv(deadline_s=10), Challenge)
    control.send_message(Attach(node_id=node_id))
    assert isinstance(control.recv(deadline_s=10), Attached)
    return control


def _join(invite: Invite, nonce: str, node_id: str, csr: str = "") -> Join:
    return Join(
        node_id=node_id,
        proof=proof(invite.secret, nonce),
        invite_id=invite.id,
        protocol_version=PROTOCOL_VERSION,
        resources=Resources(free_memory_bytes=1 << 20, bytes_per_second=1e6),
        data_host="127.0.0.1",
        data_port=9,
        csr=csr or signing_request(new_key(), "placeholder"),
    )


def _answer(link: Link) -> None:
    try:
        while True:
            message = link.recv()
            if isinstance(message, Heartbeat):
                link.send_message(Heartbeat())
            elif isinstance(message, Ping):
                link.send_message(Pong(nonce=message.nonce))
    except Exception:  # the link closed: the member is gone
        pass


def _answer_text(mesh: MeshProcesses, tokens: int = 48) -> str:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": tokens,
    }
    reply = httpx.post(f"{mesh.base_url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def _forged(request: int) -> list[TokenRow]:
    """A token that would end the answer there, as the drawing stage would send it."""
    return [
        TokenRow(
            request=request,
            position=40,
            token=42,
            hash_before=EMPTY_HASH,
            hash_after=1,
            flags=int(RowFlag.DONE),
        )
    ]


def test_every_message_a_member_sends_fits_its_control_link_cap() -> None:
    """Each kind of message a member sends, with every bounded field at its bound (text of
    characters JSON escapes to six bytes; a reason, made one line, of four-byte ones) fits the
    member control link's cap; a longer reason is cut, its line breaks blanked, so a node never
    fails to report one and no reason forges a log line."""
    name, text, emoji, big, wide = "n" * 64, "\x00", "\U0001f600", 1 << 63, -1.2345678901234567e-300
    largest = [
        Failure(request=big, reason=emoji * MAX_REASON, blame="request", plan_id=big, suspect=name),
        PeerLink(
            peer_node=name, latency_s=wide, bandwidth_bytes_per_s=wide, error=emoji * MAX_REASON
        ),
        Stats(
            node_id=name,
            decode_steps=big,
            decode_seconds=wide,
            refused_frames=big,
            sequences=big,
            kv_bytes=big,
            kept_kv_bytes=big,
            micro_batches=big,
            link_bytes={f"{i:064d}": big for i in range(64)},
        ),
        SpeedSums(sums=[wide] * 1024),
        Renew(csr=text * 4096),
        SpeedReady(),
        Heartbeat(),
        Pong(nonce=big),
        Ready(
            descriptor=Descriptor(
                node_id=name,
                plan_id=big,
                model_hash=text * 128,
                layers=(big, big),
                dtype=text * 32,
                protocol_version=big,
                shard=(big, big),
            ),
            bytes_downloaded=big,
            bytes_from_peers=big,
            resident_bytes=big,
        ),
        Loading(plan_id=big, bytes_done=big, bytes_total=big),
        Linked(plan_id=big),
    ]
    sizes = {m.kind: len(encode_message(m)) - HEADER.size for m in largest}  # type: ignore[attr-defined]
    assert max(sizes.values()) <= MEMBER_LIMITS[FrameType.CONTROL], sizes
    assert len(Failure(reason="x" * (10 * MAX_REASON)).reason) == MAX_REASON
    assert (
        Failure(reason="stage failed\n2030-01-01 forged line\r").reason
        == "stage failed 2030-01-01 forged line "
    )


def test_only_the_drawing_stage_writes_a_clients_answer(members: Members) -> None:
    """While a request is answered, a standby member and (when it does not draw) member0 send
    TOKEN frames for it on their control links, ending it with a token of their choosing: both
    are refused and counted, and the client's answer is the one it gets without them."""
    mesh = members.mesh
    reference = _answer_text(mesh)
    drawer = mesh.status()["stages"][-1]["node_id"]
    forger = attached(mesh, "forger")
    threading.Thread(
        target=_answer, args=(forger,), daemon=True
    ).start()  # it stays a member meanwhile
    while not members.opened.empty():
        members.opened.get()
    answered: dict[str, str] = {}
    asking = threading.Thread(target=lambda: answered.update(text=_answer_text(mesh)))
    asking.start()
    try:
        request = members.opened.get(timeout=120)
        forger.send_tokens(_forged(request))
        if drawer != MEMBER:
            assert members.node.control is not None
            members.node.control.send_tokens(_forged(request))
    finally:
        asking.join(timeout=300)
        forger.close()
    assert answered.get("text") == reference
    refused = mesh.status()["refused_from_members"]
    assert refused.get("forger", 0) >= 1 and (drawer == MEMBER or refused.get(MEMBER, 0) >= 1), (
        refused
    )
    assert any("refused from node forger: TOKEN frame" in line for line in mesh.output)


def _send_raw(link: Link, data: bytes) -> None:
    try:
        link.send_raw(data)
    except LinkClosed:  # closed as its header was read: what should happen
        pass


def _closed_within(link: Link, seconds: float) -> bool:
    """Whether the coordinator closes ``link`` within ``seconds`` (heartbeats and pings answered meanwhile)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = link.recv(deadline_s=left)
            if isinstance(message, Heartbeat):
                link.send_message(Heartbeat())
            elif isinstance(message, Ping):
                link.send_message(Pong(nonce=message.nonce))
        except LinkClosed as exc:
            return "in time" not in str(exc)  # closed, not merely quiet
    return False


def test_a_members_control_link_takes_no_hidden_frame_and_no_large_message(
    members: Members,
) -> None:
    """A valid message of 512 KiB (a failure report with a long reason), or a hidden frame of
    any size, closes the member's control link at its header: the coordinator allocates
    nothing for it (a 200 MiB frame does not grow its memory) and says why."""
    mesh = members.mesh
    body = json.dumps({"kind": "failure", "reason": "x" * (512 << 10)}).encode()
    large = attached(mesh, "talker")
    _send_raw(large, header(FrameType.CONTROL, len(body)) + body)
    assert _closed_within(large, 2.0)
    coordinator = psutil.Process(mesh.serve.pid if mesh.serve else 0)
    before = coordinator.memory_info().rss
    hidden = attached(mesh, "pusher")
    _send_raw(hidden, header(FrameType.HIDDEN, 200 << 20) + bytes(64 << 10))
    assert _closed_within(hidden, 2.0)
    assert coordinator.memory_info().rss - before < 64 << 20
    for link in (large, hidden):
        link.close()
    lines = (
        "node talker left: CONTROL frame of",
        "exceeds the 65536 cap",
        "node pusher left: HIDDEN frame of 209715200 bytes exceeds the 0 cap",
    )
    deadline = time.monotonic() + 10  # the coordinator's log reaches this process a little later
    while not all(line in "".join(mesh.output) for line in lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    output = "".join(mesh.output)
    assert all(line in output for line in lines), [line for line in lines if line not in output]


def test_a_node_id_that_could_forge_a_log_line_is_refused(members: Members) -> None:
    """A join whose node id holds a newline, or is 100 characters long, is refused (the
    invite unspent) with a reason that says what a node id may be; an attach likewise. The
    coordinator's log shows the id escaped: no line of it is the id's forged one."""
    mesh = members.mesh
    invite = Invite.decode(mesh.token)
    forged = (
        "2030-01-01 00:00:00,000 seamline.coordinator WARNING: node admin was made administrator"
    )
    for node_id in (f"evil\n{forged}", "x" * 100):
        with tls_link(("127.0.0.1", mesh.control_port)) as link:
            challenge = link.recv(deadline_s=10)
            assert isinstance(challenge, Challenge)
            link.send_message(_join(invite, challenge.nonce, node_id))
            answer = link.recv(deadline_s=10)
        assert isinstance(answer, Refuse) and "is not 1 to 64 of the characters" in answer.reason, (
            answer
        )
    with tls_link(("127.0.0.1", mesh.control_port), member(mesh.root, "someone")) as link:
        assert isinstance(link.recv(deadline_s=10), Challenge)
        link.send_message(Attach(node_id=f"someone\n{forged}"))
        answer = link.recv(deadline_s=10)
    assert isinstance(answer, Refuse) and "is not 1 to 64 of the characters" in answer.reason, (
        answer
    )
    time.sleep(0.5)  # the coordinator's log lines reach the output
    assert not any(line.startswith(forged) for line in mesh.output)
    assert any("refused node from" in line and "\\n2030-01-01" in line for line in mesh.output)


def _admin(mesh: MeshProcesses, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SEAMLINE_CACHE": str(mesh.root / "coordinator")}
    return subprocess.run(seamline_cmd(*args), env=env, capture_output=True, text=True, timeout=60)


def _fetches(url: str, identity: Identity, token: str = "") -> bool:
    """Whether the fragment server at ``url`` gives ``identity`` its manifest."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        reply = httpx.get(
            f"{url}/fragments/manifest.json",
            verify=identity.client_context(),
            headers=headers,
            timeout=10,
        )
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def _probes(address: tuple[str, int], identity: Identity) -> bool:
    """Whether a data port lets ``identity`` measure the link (a pong for its ping)."""
    try:
        with tls_link(address, identity) as link:
            if not isinstance(link.recv(deadline_s=10), Challenge):
                return False
            link.send_message(ProbeHello(node_id=identity.node_id))
            link.send_message(Ping(nonce=7))
            return isinstance(link.recv(deadline_s=10), Pong)
    except (LinkClosed, OSError, TlsRefused):
        return False


def test_a_removed_member_is_refused_by_every_peer_at_once(members: Members) -> None:
    """Before `node remove`, member0's certificate fetches fragments from node1 and from the
    coordinator and probes node1's data port; once it returns, every one of them refuses it
    (another member's certificate is still taken), and the invite member0 joined with is
    revoked, so its holder cannot join again under a new id."""
    mesh, node = members.mesh, members.node
    assert node.credentials is not None and node.credentials.identity is not None
    identity, assign = node.credentials.identity, members.assigns[-1]
    peer_url = assign.fragment_peers[0]
    data = next(
        tuple(n["address"].rsplit(":", 1))
        for n in mesh.status()["nodes"]
        if n["node_id"] == "node1"
    )
    address = (data[0], int(data[1]))
    assert _fetches(peer_url, identity) and _probes(address, identity)
    assert _fetches(assign.fragments_url, identity, assign.fragments_token)

    removed = _admin(mesh, "node", "remove", MEMBER)
    assert removed.returncode == 0, removed.stderr
    assert not _fetches(peer_url, identity) and not _probes(address, identity)
    assert not _fetches(assign.fragments_url, identity, assign.fragments_token)
    other = member(mesh.root, "another")
    assert _fetches(peer_url, other) and _probes(address, other)

    assert f"revoked invite {Invite.decode(mesh.token).id}" in removed.stdout, removed.stdout
    again = join_once(mesh.token, mesh.root / "again", node_id="member0-again")
    assert again.returncode != 0 and "revoked" in again.stderr, again.stderr
