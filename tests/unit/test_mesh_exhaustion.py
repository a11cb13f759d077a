"""A mesh under a member that misbehaves, on real sockets: a member that keeps talking but stops
reading its control link is lost within about the heartbeat timeout while the others' beats
keep flowing; a node skips an assignment that a newer one has replaced."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from seamline.mesh.control import heartbeats
from seamline.mesh.control.coordinator import Coordinator, CoordinatorOptions
from seamline.mesh.control.invites import InviteBook
from seamline.mesh.control.mesh_state import NodeAdmitted
from seamline.mesh.control.node_handle import NodeHandle
from seamline.mesh.node.process import Node, NodeOptions
from seamline.mesh.plan.types import ModelSpec
from seamline.mesh.protocol.invite import Invite
from seamline.net.link import Link, LinkClosed, listen, tune
from seamline.net.messages import (
    PROTOCOL_VERSION,
    Assign,
    Heartbeat,
    Join,
    Ping,
    Pong,
    Resources,
)

TIMEOUT_S = 1.5  # the heartbeat timeout: a beat every 0.125 s
ANSWER_LAG_S = 0.2  # a loaded member's answer to a beat


def _coordinator() -> Coordinator:
    where = Invite(("127.0.0.1",), 1, 2, "secret", time.time() + 600)
    spec = ModelSpec("m", 2, 8, (1, 1), 1, 1, 1, 8)
    return Coordinator(
        InviteBook(where), spec, "hash", CoordinatorOptions(heartbeat_timeout_s=TIMEOUT_S)
    )


def _member(coordinator: Coordinator, node_id: str, buffer: int = 0) -> socket.socket:
    """A member on a real TCP link: the coordinator reads it as it reads any member; the
    member's end comes back (with small buffers when ``buffer``, so it fills fast)."""
    server = listen("127.0.0.1", 0)
    theirs = socket.socket()
    if buffer:
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    theirs.connect(server.getsockname())
    ours, _ = server.accept()
    server.close()
    if buffer:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
    join = Join(
        node_id=node_id,
        proof="",
        protocol_version=PROTOCOL_VERSION,
        data_host="127.0.0.1",
        data_port=1,
        resources=Resources(free_memory_bytes=1 << 30, bytes_per_second=1e9),
    )
    handle = NodeHandle(join, Link(tune(ours), name=f"node {node_id}"))
    coordinator.apply(NodeAdmitted(handle))
    threading.Thread(target=coordinator.read_node, args=(handle,), daemon=True).start()
    return tune(theirs)


def test_a_member_that_stops_reading_is_lost_and_the_others_keep_their_beats() -> None:
    """ "stuck" sends a heartbeat every 0.3 s but reads nothing, while a coordinator thread sends
    it large messages until one blocks; "honest" answers every beat (a ping with a fresh nonce).
    "stuck" answers none and is taken for lost about the heartbeat timeout after its first
    beat, which frees the blocked sender; "honest" gets a beat every 0.5 s throughout and stays."""
    coordinator = _coordinator()
    honest = Link(_member(coordinator, "honest"), "honest")
    stuck = _member(coordinator, "stuck", buffer=32 << 10)
    beats: list[float] = []

    def answer() -> None:
        try:
            while True:
                if isinstance(
                    beat := honest.recv(), Ping
                ):  # a heartbeat is a ping with a fresh nonce
                    beats.append(time.monotonic())
                    honest.send_message(Pong(nonce=beat.nonce))
        except LinkClosed:
            pass

    def talk_without_reading() -> None:
        talker = Link(stuck, "stuck")
        try:
            while True:
                talker.send_message(Heartbeat())
                time.sleep(0.3)
        except LinkClosed:
            pass

    freed: list[float] = []

    def flood() -> None:
        try:
            for nonce in range(1000):
                coordinator.nodes["stuck"].link.send_message(
                    Ping(nonce=nonce, pad="x" * (256 << 10))
                )
        except LinkClosed:
            freed.append(time.monotonic())

    for target in (answer, talk_without_reading):
        threading.Thread(target=target, daemon=True).start()
    began = time.monotonic()
    threading.Thread(
        target=flood, daemon=True
    ).start()  # blocks once the stuck member's buffers fill
    heartbeats.watch(coordinator, TIMEOUT_S)
    while "stuck" in coordinator.nodes and time.monotonic() - began < 20:
        time.sleep(0.05)
    lost_after = time.monotonic() - began
    time.sleep(1.5)
    assert lost_after < TIMEOUT_S + 2.0, lost_after
    assert freed and freed[0] - began < TIMEOUT_S + 2.0, freed
    assert "honest" in coordinator.nodes
    heard = [t for t in beats if t > began - 1.0] + [
        time.monotonic()
    ]  # the silence since the last beat counts too
    gaps = [b - a for a, b in zip(heard, heard[1:])]
    assert len(gaps) >= 5 and max(gaps) < 1.2, gaps
    honest.close()
    stuck.close()


def test_a_node_skips_an_assignment_a_newer_one_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two assignments queue up while the node is busy (neither fits its memory, so each that is
    taken fails at once): only the newer is taken; the older is skipped with one line."""
    invite = Invite(("127.0.0.1",), 1, 2, "secret", time.time() + 600)
    node = Node(
        invite,
        NodeOptions(max_memory_bytes=1 << 20, node_id="n", cache_dir=tmp_path, progress=False),
    )

    def assign(plan_id: int) -> Assign:
        return Assign(
            plan_id=plan_id,
            model_hash="h",
            fragments_url="",
            layers=(0, 1),
            owns_embedding=True,
            owns_head=True,
            dtype="float32",
            context_length=64,
            memory_bytes=1 << 40,
        )

    node._inbox.put(assign(1))
    node._inbox.put(assign(2))
    with caplog.at_level(logging.INFO, logger="seamline.node"):
        threading.Thread(target=node._handle_control, daemon=True).start()
        deadline = time.monotonic() + 20
        while not any("failed to handle Assign" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        time.sleep(0.5)
    assert node.assignment is not None and node.assignment.plan_id == 2
    failures = [r for r in caplog.records if "failed to handle Assign" in r.getMessage()]
    assert len(failures) == 1, caplog.text
    assert any("skipped the assignment of plan 1" in r.getMessage() for r in caplog.records), (
        caplog.text
    )


def test_a_member_that_falls_silent_is_lost_a_beat_after_the_timeout() -> None:
    """ "quiet" answers every beat ANSWER_LAG_S late (a loaded node), then stops as a SIGSTOP
    stops it (its link open, nothing read or sent). It is taken for lost once it has been silent
    the heartbeat timeout, give or take one beat's spacing: silence is judged only at a beat, so
    with beats a second apart a node stopped in a 3 s timeout was found 3.0-3.8 s after its last
    word (here: beats 0.5 s apart found it 1.8 s after, in a 1.5 s timeout)."""
    coordinator = _coordinator()
    quiet = Link(_member(coordinator, "quiet"), "quiet")
    stop = threading.Event()
    last_answer: list[float] = []

    def answer(nonce: int) -> None:
        quiet.send_message(Pong(nonce=nonce))
        last_answer.append(time.monotonic())

    def answer_late_until_stopped() -> None:
        while isinstance(beat := quiet.recv(), Ping) and not stop.is_set():
            threading.Timer(ANSWER_LAG_S, answer, args=(beat.nonce,)).start()

    threading.Thread(target=answer_late_until_stopped, daemon=True).start()
    heartbeats.watch(coordinator, TIMEOUT_S)
    time.sleep(1.0)
    stop.set()  # from its next beat on, nothing is answered
    while "quiet" in coordinator.nodes and time.monotonic() - last_answer[-1] < 10:
        time.sleep(0.01)
    lost_after = time.monotonic() - last_answer[-1]
    assert TIMEOUT_S - ANSWER_LAG_S <= lost_after < TIMEOUT_S + 0.22, lost_after
