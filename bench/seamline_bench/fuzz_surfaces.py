"""How `seamline bench fuzz` reaches each listening surface, before and after its handshake.

Each ``*_surface`` function sends ``count`` inputs and returns how many it sent. Before the
handshake an input goes on a fresh connection (TCP, or TLS without the right certificate);
after it, inputs follow each other on a link authenticated as a member (a certificate from
the mesh CA, and for a stage's data port the plan's link key), and a link the target closes
(as it should on a malformed frame) is made again.
"""

from __future__ import annotations

import secrets
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from seamline.mesh.identity import (
    Identity,
    MeshAuthority,
    enrolling_context,
    key_pem,
    new_key,
    signing_request,
)
from seamline.mesh.node.data_links import PROBE, LinkRefused, admit, data_proof
from seamline.mesh.node.peer_probe import ProbeRefused, answer_probe
from seamline.mesh.protocol.claims import block_sums, probe_matrix
from seamline.mesh.protocol.invite import Invite, proof
from seamline.mesh.protocol.relay_wire import RELAY_MAGIC
from seamline.net.frames import FrameError
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    Certificate,
    Challenge,
    Close,
    DataHello,
    Descriptor,
    Failure,
    Forget,
    Fork,
    Heartbeat,
    Join,
    Linked,
    MeasurePeer,
    Open,
    PeerLink,
    Ping,
    Pong,
    ProbeHello,
    Ready,
    RelayAccept,
    Renew,
    Resources,
    SpeedProbe,
    SpeedReady,
    SpeedSums,
    Stats,
    Welcome,
)
from seamline.net.tls import TlsRefused, TlsSocket, group_tls_from_folder
from seamline.parallel.tcp_comm import GATE, GATE_MAGIC, VERSION, hello_bytes
from seamline.params import SamplingParams
from seamline_bench.fuzz_inputs import Inputs

SHORT_S = 2.0  # a connection's timeout: the fuzzer never waits on one for long


@dataclass
class Target:
    api: str  # http://host:port
    control: tuple[str, int]
    stages: list[tuple[str, tuple[str, int]]]  # (node id, data address), pipeline order
    plan_id: int
    link_key: str
    authority: MeshAuthority
    fragment_token: str
    invite: str  # a token the fuzzer may join with (any number of uses)
    hidden_size: int
    comm: tuple[str, int]
    comm_tls: Path


def _connect(address: tuple[str, int]) -> socket.socket | None:
    try:
        return socket.create_connection(address, timeout=SHORT_S)
    except OSError:
        return None


def _fire(address: tuple[str, int], data: bytes, context: ssl.SSLContext | None = None) -> None:
    """One input on a fresh connection (after a TLS handshake with ``context``), then hang up."""
    sock = _connect(address)
    if sock is None:
        return
    try:
        channel = (
            TlsSocket.handshake(sock, context, False, SHORT_S) if context is not None else sock
        )
        channel.sendall(data)
    except (OSError, TlsRefused):
        pass
    finally:
        sock.close()


# -- HTTP: the OpenAI API and the fragment server -------------------------------------------------
CHAT = {
    "model": "default",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 1,
    "temperature": 0,
}
PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/x",
    "/api/status",
    "/api/admin/invites",
]


def http_surface(target: Target, inputs: Inputs, count: int, fragments: bool = False) -> int:
    host, port = httpx.URL(target.api).host, httpx.URL(target.api).port or 80
    with httpx.Client(base_url=target.api, timeout=1.0) as client:
        for i in range(count):
            if i % 5 == 0:  # before any parsing: raw bytes, a broken request line or header block
                raw = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n"
                _fire((host, port), inputs.broken(raw) if i % 2 else inputs.garbage())
                continue
            try:
                if fragments:
                    _fragment_request(client, target, inputs)
                else:
                    path = PATHS[0] if inputs.rng.random() < 0.8 else inputs.rng.choice(PATHS)
                    client.post(path, content=inputs.http_body(CHAT), headers=inputs.http_headers())
            except httpx.HTTPError:
                pass  # a timeout (a mutated request that generates) or a refusal: the server's business
    return count


def _fragment_request(client: httpx.Client, target: Target, inputs: Inputs) -> None:
    name = inputs.rng.choice(
        ["manifest.json", secrets.token_hex(32), "../../etc/passwd", "%00", "a" * 3000, ""]
    )
    headers = inputs.http_headers()
    if inputs.rng.random() < 0.8:
        headers["Authorization"] = f"Bearer {target.fragment_token}"
    client.get(f"/fragments/{name}", headers=headers)


# -- the control port -------------------------------------------------------------------------------
def control_surface(target: Target, inputs: Inputs, count: int) -> int:
    sent = 0
    while sent < count:
        if sent % 2 == 0:  # before the handshake: plaintext, or TLS without a join
            frame = (
                inputs.broken(inputs.valid_control(Challenge(nonce="n")))
                if sent % 4
                else inputs.garbage()
            )
            _fire(target.control, frame, enrolling_context() if sent % 8 < 4 else None)
            sent += 1
            continue
        link = _join(target, inputs)
        if link is None:
            sent += 1
            continue
        sent += _member_inputs(link, inputs, min(200, count - sent), _control_messages(inputs))
        link.close()
    return sent


def _join(target: Target, inputs: Inputs) -> Link | None:
    """A member of the mesh (joined with the fuzzer's invite after the plan is made: it is never
    planned): enrolled, then attached on its control link proper under its certificate, where a
    thread answers the coordinator's pings and speed probe as a node does."""
    invite = Invite.decode(target.invite)
    key, node_id = new_key(), f"fuzz-{secrets.token_hex(4)}"
    try:
        with Link.connect(*target.control, timeout=SHORT_S, tls=enrolling_context()) as link:
            challenge = link.recv(deadline_s=SHORT_S)
            assert isinstance(challenge, Challenge)
            link.send_message(
                Join(
                    node_id=node_id,
                    proof=proof(invite.secret, challenge.nonce),
                    invite_id=invite.id,
                    protocol_version=PROTOCOL_VERSION,
                    resources=Resources(free_memory_bytes=1 << 20, bytes_per_second=1e6),
                    data_host="127.0.0.1",
                    data_port=9,
                    csr=signing_request(key, node_id),
                )
            )
            welcome = link.recv(deadline_s=SHORT_S)
            assert isinstance(welcome, Welcome)
        identity = Identity(
            node_id, key_pem(key).decode(), welcome.certificate, challenge.ca_certificate
        )
        member = Link.connect(*target.control, timeout=SHORT_S, tls=identity.client_context())
        assert isinstance(member.recv(deadline_s=SHORT_S), Challenge)
        member.send_message(Attach(node_id=node_id))
        assert isinstance(member.recv(deadline_s=SHORT_S), Attached)
    except (OSError, LinkClosed, AssertionError, TlsRefused):
        return None
    threading.Thread(
        target=_answer_coordinator, args=(member, identity, target.control), daemon=True
    ).start()
    return member


def _answer_coordinator(link: Link, identity: Identity, control: tuple[str, int]) -> None:
    """Pongs, the speed probe and the link probes, as a node answers them (``Node._on_control``):
    the fuzzed member takes no inbound connection, so members probe it through the relay."""
    matrix = None
    try:
        while True:
            message = link.recv()
            if isinstance(message, Heartbeat):
                link.send_message(Heartbeat())
            elif isinstance(message, Ping):
                link.send_message(Pong(nonce=message.nonce))
            elif isinstance(message, SpeedProbe) and not message.vector:
                matrix = probe_matrix(message.seed, message.rows, message.cols)
                link.send_message(SpeedReady())
            elif isinstance(message, SpeedProbe) and matrix is not None:
                link.send_message(SpeedSums(sums=block_sums(matrix, torch.tensor(message.vector))))
            elif isinstance(message, RelayAccept) and message.probe:
                threading.Thread(
                    target=_probed, args=(message.ticket, identity, control), daemon=True
                ).start()
            elif isinstance(message, MeasurePeer):
                link.send_message(
                    PeerLink(peer_node=message.peer_node, error="a fuzzed member measures nothing")
                )
    except (LinkClosed, FrameError):
        pass


def _probed(ticket: str, identity: Identity, control: tuple[str, int]) -> None:
    """A member's probe through the relay, answered as a node's data port does."""
    try:
        sock = socket.create_connection(control, timeout=SHORT_S * 5)
        sock.sendall(RELAY_MAGIC + ticket.encode())
        link = Link(TlsSocket.handshake(sock, identity.server_context(), True, SHORT_S * 5))
        if admit(link, None, certified=True) == PROBE:
            answer_probe(link)
    except (OSError, LinkClosed, FrameError, TlsRefused, LinkRefused, ProbeRefused):
        pass


def _control_messages(inputs: Inputs) -> Callable[[], bytes]:
    samples = [
        Ready(
            descriptor=Descriptor(
                node_id="x",
                plan_id=1,
                model_hash="m",
                layers=(0, 1),
                dtype="float32",
                protocol_version=PROTOCOL_VERSION,
            )
        ),
        Linked(plan_id=1),
        Failure(request=inputs.request_id(), reason="r"),
        Failure(reason="r"),
        Stats(node_id="x", decode_steps=1, decode_seconds=1.0, refused_frames=0),
        Heartbeat(),
        Renew(csr="-----BEGIN CERTIFICATE REQUEST-----"),
        Certificate(certificate="c"),
        PeerLink(peer_node="node0", latency_s=1e-4, bandwidth_bytes_per_s=1e9),
    ]

    def one() -> bytes:
        message = inputs.rng.choice(samples)
        if inputs.rng.random() < 0.1:
            return inputs.broken(inputs.valid_control(message))
        return (
            inputs.control(message) if inputs.rng.random() < 0.7 else inputs.valid_control(message)
        )

    return one


def _member_inputs(link: Link, inputs: Inputs, count: int, make: Callable[[], bytes]) -> int:
    """Send up to ``count`` inputs on an authenticated link; stop early when the target closes it."""
    for i in range(count):
        try:
            link.send_raw(make())
        except LinkClosed:
            return i + 1
    return count


# -- a stage's data port ----------------------------------------------------------------------------
def data_surface(target: Target, inputs: Inputs, count: int, stage: int) -> int:
    """Stage 1 is fuzzed as its upstream (hidden frames and session messages), stage 0 as the
    last stage (tokens); before the handshake, as a member the plan does not name."""
    node_id, address = target.stages[stage]
    sender = target.stages[stage - 1][0] if stage > 0 else target.stages[-1][0]
    stranger = target.authority.identity(f"fuzz-{secrets.token_hex(3)}", 3600).client_context()
    member = target.authority.identity(sender, 3600).client_context()
    make = _stage_frames(inputs, target.hidden_size) if stage > 0 else inputs.tokens
    sent = 0
    while sent < count:
        if sent % 3 == 0:
            hello = inputs.valid_control(
                DataHello(node_id=sender, plan_id=target.plan_id, proof="0" * 64)
            )
            frame = inputs.rng.choice([inputs.garbage(), inputs.broken(hello), make()])
            _fire(address, frame, inputs.rng.choice([stranger, member, None]))
            sent += 1
            continue
        probe = sent % 10 == 1  # a member's link probe: pings, some mutated
        link = _admitted(target, address, sender, member, probe)
        if link is None:
            sent += 1
            continue
        sent += _member_inputs(
            link, inputs, min(8 if probe else 500, count - sent), _pings(inputs) if probe else make
        )
        link.close()
    return sent


def _admitted(
    target: Target,
    address: tuple[str, int],
    sender: str,
    context: ssl.SSLContext,
    probe: bool = False,
) -> Link | None:
    try:
        link = Link.connect(*address, timeout=SHORT_S, tls=context)
        challenge = link.recv(deadline_s=SHORT_S)
        assert isinstance(challenge, Challenge)
        answer = data_proof(target.link_key, challenge.nonce, sender, target.plan_id)
        link.send_message(
            ProbeHello(node_id=sender)
            if probe
            else DataHello(node_id=sender, plan_id=target.plan_id, proof=answer)
        )
        return link
    except (OSError, LinkClosed, AssertionError, TlsRefused):
        return None


def _pings(inputs: Inputs) -> Callable[[], bytes]:
    def one() -> bytes:
        ping = Ping(
            nonce=inputs.rng.randrange(1 << 20), pad="x" * inputs.rng.choice([0, 1000, 1 << 18])
        )
        return inputs.control(ping) if inputs.rng.random() < 0.5 else inputs.valid_control(ping)

    return one


def _stage_frames(inputs: Inputs, hidden_size: int) -> Callable[[], bytes]:
    def one() -> bytes:
        pick = inputs.rng.random()
        if pick < 0.6:
            return inputs.hidden(hidden_size)
        request = inputs.request_id()
        message = inputs.rng.choice(
            [
                Open(request=request, sampling=SamplingParams(), prompt_len=3, context_length=64),
                Fork(request=request, donor=inputs.request_id(), positions=4, hash=1),
                Forget(request=request),
                Close(request=request),
            ]
        )
        return inputs.control(message) if pick < 0.9 else inputs.valid_control(message)

    return one


# -- a lockstep rank's comm port --------------------------------------------------------------------
def comm_surface(target: Target, inputs: Inputs, count: int) -> int:
    """The target is rank 1 of 2 (``fuzz_comm_target``); the fuzzer dials as rank 0."""
    tls = group_tls_from_folder(target.comm_tls, 0, 2)
    sent = 0
    while sent < count:
        sock = _connect(target.comm)
        if sock is None:
            continue
        try:
            if sent % 3 == 0:  # before TLS: bytes, or a HELLO in the clear
                sock.sendall(
                    inputs.rng.choice([inputs.garbage(), inputs.broken(hello_bytes(0, 2, "fuzz"))])
                )
                sent += 1
                continue
            channel = TlsSocket.handshake(sock, tls.client, False, SHORT_S)
            sent += _comm_inputs(channel, inputs)
        except (OSError, TlsRefused):
            sent += 1
        finally:
            sock.close()
    return sent


def _comm_inputs(channel: TlsSocket, inputs: Inputs) -> int:
    """A HELLO (mutated one time in four), then valid gates and one mutated gate header."""
    hello = hello_bytes(0, 2, "fuzz")
    if inputs.rng.random() < 0.25:
        channel.sendall(inputs.broken(hello))
        return 1
    channel.sendall(hello)
    drain = threading.Thread(target=_drain, args=(channel,), daemon=True)
    drain.start()
    sent = 1
    for sequence in range(inputs.rng.randrange(1, 20)):
        part = torch.randn(8)
        channel.sendmsg(
            [GATE.pack(GATE_MAGIC, VERSION, 1, 0, 0, sequence, 1, 8), part.numpy().tobytes()]
        )
        sent += 1
    head = bytearray(GATE.pack(GATE_MAGIC, VERSION, 1, 0, 0, sequence + 1, 1, 8))
    offset = inputs.rng.choice([0, 4, 5, 6, 8, 12, 20, 24])
    struct.pack_into("<I", head, min(offset, GATE.size - 4), inputs.rng.getrandbits(32))
    channel.sendall(bytes(head) + inputs.garbage(64))
    return sent + 1


def _drain(channel: TlsSocket) -> None:
    buffer = memoryview(bytearray(65536))
    try:
        while channel.recv_into(buffer):
            pass
    except OSError:
        pass
