"""Attackers that are members of a live mesh (`seamline bench fuzz`'s ``attacks``): each enrolls
with an invite of its own (so removing it revokes no honest node's) and claims 1 MiB of memory,
so it is never planned. The attacks, each run for ``duration_s``:

- ``forged_pongs``: pongs for guessed nonces before any ping, and link reports out of physical
  bounds, asked for and unasked;
- ``oversize_member_frames``: a 512 KiB control message, and a 200 MiB hidden frame's header;
- ``removed_member``: what a member's certificate opens before `node remove` and after it.

Moved here from the tests that first played them (test_mesh_members, test_measurements).
"""

from __future__ import annotations

import json
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from seamline.mesh.identity import (
    Identity,
    enrolling_context,
    key_pem,
    new_key,
    signing_request,
)
from seamline.mesh.node.data_links import PROBE, LinkRefused, admit
from seamline.mesh.node.peer_probe import ProbeRefused, answer_probe
from seamline.mesh.protocol.claims import block_sums, probe_matrix
from seamline.mesh.protocol.invite import Invite, proof
from seamline.mesh.protocol.relay_wire import RELAY_MAGIC
from seamline.net.frames import FrameError, FrameType, header
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    Challenge,
    Heartbeat,
    Join,
    MeasurePeer,
    PeerLink,
    Ping,
    Pong,
    ProbeHello,
    Rejoin,
    RelayAccept,
    Resources,
    SpeedProbe,
    SpeedReady,
    SpeedSums,
    Welcome,
)
from seamline.net.tls import TlsRefused, TlsSocket

Address = tuple[str, int]
SHORT_S = 10.0
FORGED_LATENCY_S, FORGED_BANDWIDTH = -0.057e-3, 262e9  # what early pongs once measured


class AttackRefused(Exception):
    """The mesh would not take the attacker as a member (what it should do after a removal)."""


def emit(record: dict[str, Any]) -> None:
    """One JSON line to the bench (stdout carries nothing else)."""
    print(json.dumps(record), flush=True)


def enroll(control: Address, token: str, node_id: str) -> Identity:
    """Prove the invite over TLS and get a certificate naming ``node_id`` (AttackRefused if not)."""
    invite, key = Invite.decode(token), new_key()
    with Link.connect(*control, timeout=SHORT_S, tls=enrolling_context()) as link:
        challenge = link.recv(deadline_s=SHORT_S)
        assert isinstance(challenge, Challenge), challenge
        link.send_message(_join(invite, challenge.nonce, node_id, signing_request(key, node_id)))
        welcome = link.recv(deadline_s=SHORT_S)
    if not isinstance(welcome, Welcome):
        raise AttackRefused(getattr(welcome, "reason", type(welcome).__name__))
    return Identity(node_id, key_pem(key).decode(), welcome.certificate, challenge.ca_certificate)


def _join(invite: Invite, nonce: str, node_id: str, csr: str) -> Join:
    return Join(
        node_id=node_id,
        proof=proof(invite.secret, nonce),
        invite_id=invite.id,
        protocol_version=PROTOCOL_VERSION,
        resources=Resources(free_memory_bytes=1 << 20, bytes_per_second=1e6),
        data_host="127.0.0.1",
        data_port=9,
        csr=csr,
    )


def attach(control: Address, identity: Identity, rejoin: bool = False) -> Link:
    """The control link proper under ``identity`` (AttackRefused if the coordinator will not take it)."""
    link = Link.connect(*control, timeout=SHORT_S, tls=identity.client_context())
    assert isinstance(link.recv(deadline_s=SHORT_S), Challenge)
    if rejoin:
        join = _join(Invite(("127.0.0.1",), control[1], 0, "x", 0.0), "n", identity.node_id, "")
        link.send_message(Rejoin(join=join))
    else:
        link.send_message(Attach(node_id=identity.node_id))
    answer = link.recv(deadline_s=SHORT_S)
    if not isinstance(answer, Attached):
        link.close()
        raise AttackRefused(getattr(answer, "reason", type(answer).__name__))
    return link


@dataclass
class Answering:
    """What a played member answers the coordinator (as ``Node._on_control`` does); ``report``
    makes its answer to a MeasurePeer."""

    link: Link
    identity: Identity
    control: Address
    report: Callable[[MeasurePeer], PeerLink] = lambda m: PeerLink(
        peer_node=m.peer_node, error="not measured"
    )
    asked: list[str] = field(default_factory=list)  # the peers it was asked to measure
    pings: int = 0

    def start(self) -> Answering:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        matrix = None
        try:
            while True:
                message = self.link.recv()
                if isinstance(message, Heartbeat):
                    self.link.send_message(Heartbeat())
                elif isinstance(message, Ping):
                    self.pings += 1
                    self.link.send_message(Pong(nonce=message.nonce))
                elif isinstance(message, SpeedProbe) and not message.vector:
                    matrix = probe_matrix(message.seed, message.rows, message.cols)
                    self.link.send_message(SpeedReady())
                elif isinstance(message, SpeedProbe) and matrix is not None:
                    self.link.send_message(
                        SpeedSums(sums=block_sums(matrix, torch.tensor(message.vector)))
                    )
                elif isinstance(message, RelayAccept) and message.probe:
                    threading.Thread(
                        target=self._probed, args=(message.ticket,), daemon=True
                    ).start()
                elif isinstance(message, MeasurePeer):
                    self.asked.append(message.peer_node)
                    self.link.send_message(self.report(message))
        except (LinkClosed, FrameError, OSError):
            pass

    def _probed(self, ticket: str) -> None:
        """A member's probe through the relay, answered as a node's data port does."""
        try:
            sock = socket.create_connection(self.control, timeout=SHORT_S)
            sock.sendall(RELAY_MAGIC + ticket.encode())
            link = Link(TlsSocket.handshake(sock, self.identity.server_context(), True, SHORT_S))
            if admit(link, None, certified=True) == PROBE:
                answer_probe(link)
        except (OSError, LinkClosed, FrameError, TlsRefused, LinkRefused, ProbeRefused):
            pass


def member(control: Address, token: str, prefix: str, **answering: Any) -> Answering:
    node_id = f"{prefix}-{secrets.token_hex(3)}"
    identity = enroll(control, token, node_id)
    return Answering(attach(control, identity), identity, control, **answering)


# -- forged_pongs -------------------------------------------------------------------------------
def forged_pongs(target: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """Pongs for the nonces a counter would use (and random ones), sent before any ping and on
    through the attack; link reports with negative latency and 262 GB/s, for the pairs the
    coordinator asks it to measure and, unasked, for every honest node."""
    control, began = _address(target["control"]), time.monotonic()
    forged = lambda m: _forged_link(m.peer_node)
    node_id = f"pongs-{secrets.token_hex(3)}"
    identity = enroll(control, target["invite"], node_id)
    link = attach(control, identity)
    pongs = reports = 0
    for guess in range(
        1, 6
    ):  # before the coordinator's first ping: what a counter from 1 would use
        link.send_message(Pong(nonce=guess))
        pongs += 1
    answering = Answering(link, identity, control, report=forged).start()
    honest = [n["node_id"] for n in target["nodes"]]
    try:
        while time.monotonic() - began < duration_s:
            link.send_message(Pong(nonce=secrets.randbits(62)))
            for peer in honest:
                link.send_message(_forged_link(peer))
            pongs, reports = pongs + 1, reports + len(honest)
            time.sleep(0.5)
    except LinkClosed:
        pass
    link.close()
    return {
        "node_id": node_id,
        "pongs_sent": pongs,
        "link_reports_sent": reports + len(answering.asked),
        "asked_to_measure": answering.asked,
        "pings_answered": answering.pings,
    }


def _forged_link(peer: str) -> PeerLink:
    return PeerLink(
        peer_node=peer, latency_s=FORGED_LATENCY_S, bandwidth_bytes_per_s=FORGED_BANDWIDTH
    )


# -- oversize_member_frames -----------------------------------------------------------------------
def oversize_member_frames(target: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """Members that send, each on its control link, a valid 512 KiB message or the header of a
    200 MiB hidden frame: each link must be closed at the header, within 2 s."""
    control, began = _address(target["control"]), time.monotonic()
    body = json.dumps({"kind": "failure", "reason": "x" * (512 << 10)}).encode()
    frames = {
        "control_512k": header(FrameType.CONTROL, len(body)) + body,
        "hidden_200m": header(FrameType.HIDDEN, 200 << 20) + bytes(64 << 10),
    }
    sent, closed, ids = 0, 0, []
    while time.monotonic() - began < duration_s:
        for kind, frame in frames.items():
            played = member(control, target["invite"], f"big-{kind[:6]}")
            ids.append(played.identity.node_id)
            try:
                played.link.send_raw(frame)
            except LinkClosed:
                pass  # closed as its header was read
            sent += 1
            closed += _closed_within(played.link, 2.0)
            played.link.close()
        time.sleep(1.0)
    return {
        "frames_sent": sent,
        "links_closed": closed,
        "refused": sent > 0 and closed == sent,
        "members": ids,
    }


def _closed_within(link: Link, seconds: float) -> bool:
    """Whether the coordinator closes ``link`` within ``seconds`` (its beats and pings answered)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = link.recv(deadline_s=left)
            if isinstance(message, Heartbeat):
                link.send_message(Heartbeat())
            elif isinstance(message, Ping):
                link.send_message(Pong(nonce=message.nonce))
        except (LinkClosed, FrameError) as exc:
            return "in time" not in str(exc)  # closed, not merely quiet
    return False


# -- removed_member -------------------------------------------------------------------------------
def removed_member(target: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """A member tries its certificate on every honest data and fragment port, and the
    coordinator's fragment port, before `node remove` (the bench removes it when told
    ``member``) and, for ``duration_s``, after it; then rejoin under it, and join again with
    the invite it joined with."""
    control = _address(target["control"])
    played = member(control, target["invite"], "removed").start()
    before = _opens(target, played.identity)
    emit({"member": played.identity.node_id, "before": before})
    sys.stdin.readline()  # "removed": `node remove` has returned
    after: dict[str, int] = {}
    began = time.monotonic()
    while time.monotonic() - began < duration_s:
        for what, opened in {
            **_opens(target, played.identity),
            **_comes_back(control, target, played),
        }.items():
            after[what] = after.get(what, 0) + int(opened)
        time.sleep(1.0)
    return {
        "node_id": played.identity.node_id,
        "before_removal": before,
        "opened_after_removal": after,
        "refused": bool(after) and not any(after.values()),
    }


def _opens(target: dict[str, Any], identity: Identity) -> dict[str, bool]:
    """What the certificate opens now: each honest data port (a link probe answered) and
    fragment port (the manifest), and the coordinator's fragment port (its TLS handshake)."""
    out = {}
    for node in target["nodes"]:
        out[f"{node['node_id']}:data"] = _probes(_address(node["data"]), identity)
        for port in node["other_ports"]:
            out[f"{node['node_id']}:{port}"] = _fetches(f"https://127.0.0.1:{port}", identity)
    out["coordinator:fragments"] = _handshakes(_address(target["fragments"]), identity)
    return out


def _comes_back(control: Address, target: dict[str, Any], played: Answering) -> dict[str, bool]:
    """Whether the removed member gets back in: under its certificate, or with its invite."""
    out = {}
    for what, attempt in (
        ("rejoin", lambda: attach(control, played.identity, rejoin=True)),
        ("attach", lambda: attach(control, played.identity)),
        ("join_again", lambda: enroll(control, target["invite"], f"again-{secrets.token_hex(3)}")),
    ):
        try:
            got = attempt()
            out[what] = True
            if isinstance(got, Link):
                got.close()
        except (AttackRefused, LinkClosed, FrameError, OSError, TlsRefused, AssertionError):
            out[what] = False
    return out


def _probes(address: Address, identity: Identity) -> bool:
    try:
        with Link.connect(*address, timeout=SHORT_S, tls=identity.client_context()) as link:
            if not isinstance(link.recv(deadline_s=SHORT_S), Challenge):
                return False
            link.send_message(ProbeHello(node_id=identity.node_id))
            link.send_message(Ping(nonce=7))
            return isinstance(link.recv(deadline_s=SHORT_S), Pong)
    except (LinkClosed, FrameError, OSError, TlsRefused):
        return False


def _fetches(url: str, identity: Identity) -> bool:
    try:
        reply = httpx.get(
            f"{url}/fragments/manifest.json", verify=identity.client_context(), timeout=SHORT_S
        )
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def _handshakes(address: Address, identity: Identity) -> bool:
    """Whether a TLS server takes ``identity``'s certificate (and answers an HTTP request at all)."""
    try:
        reply = httpx.get(
            f"https://{address[0]}:{address[1]}/fragments/manifest.json",
            verify=identity.client_context(),
            timeout=SHORT_S,
        )
    except httpx.HTTPError:
        return False
    return reply.status_code != 403


def _address(value: list[Any] | tuple[Any, ...]) -> Address:
    return str(value[0]), int(value[1])
