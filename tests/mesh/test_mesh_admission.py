"""Admission and failure: not ready until planned, bad tokens refused, a lost node fails cleanly."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from seamline.mesh.protocol.invite import Invite
from seamline.net.frames import (
    HANDSHAKE_DEADLINE_S,
    HEADER,
    MAGIC,
    FrameType,
    header,
    parse_header,
)
from seamline.net.tls import TlsSocket
from seamline.server.demo import memory_cap_gb
from tests.support.mesh import assert_join_refused
from tests.support.mesh_harness import MeshProcesses
from tests.support.tls_peers import tls_socket

REPLAY_DEADLINE_S = 3
CONTEXT = 1024


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    mesh = MeshProcesses(
        tmp_path_factory.mktemp("admission"),
        nodes=2,
        node_memory_gb=memory_cap_gb(None, 2, CONTEXT),
        serve_args=("--context", str(CONTEXT), "--replay-deadline", str(REPLAY_DEADLINE_S)),
    )
    mesh.start(join=False)
    try:
        yield mesh
    finally:
        mesh.stop()


def _wait_http(mesh: MeshProcesses) -> httpx.Response:
    deadline = time.monotonic() + 60
    while True:
        try:
            return httpx.get(f"{mesh.base_url}/health", timeout=5)
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_not_ready_until_the_expected_nodes_join(mesh: MeshProcesses) -> None:
    health = _wait_http(mesh)
    assert health.status_code == 503 and "waiting for nodes" in health.json()["reason"]
    with pytest.raises(openai.APIStatusError) as error:
        mesh.client().chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}]
        )
    assert error.value.status_code == 503 and "waiting for nodes" in str(error.value)


def test_wrong_expired_and_corrupt_tokens_are_refused(mesh: MeshProcesses) -> None:
    good = Invite.decode(mesh.token)
    wrong = dataclasses.replace(good, secret="0" * 32).encode()
    assert_join_refused(mesh, wrong, "wrong invite token")
    expired = dataclasses.replace(good, expires=time.time() - 5).encode()
    assert_join_refused(mesh, expired, "expired")
    assert_join_refused(mesh, mesh.token[:-6], "corrupt")
    assert len(mesh.status()["nodes"]) == 0  # none of them was admitted


def _challenged(mesh: MeshProcesses) -> TlsSocket:
    """A TLS connection to the control port (no certificate: a joining node) that has read the
    coordinator's challenge."""
    sock = tls_socket(("127.0.0.1", mesh.control_port))
    _, length = parse_header(_read(sock, HEADER.size))
    _read(sock, length)
    return sock


def _read(sock: TlsSocket, size: int) -> bytes:
    data = bytearray(size)
    got = 0
    while got < size:
        n = sock.recv_into(memoryview(data)[got:])
        assert n, "closed"
        got += n
    return bytes(data)


def _closed_within(sock: TlsSocket, seconds: float) -> float:
    began = time.monotonic()
    sock.settimeout(seconds)
    try:
        assert sock.recv_into(memoryview(bytearray(1))) == 0
    except ConnectionResetError:
        pass
    return time.monotonic() - began


def _until_closed(sock: socket.socket, seconds: float) -> bytes | None:
    """Everything the peer sends until it closes; None if it has not closed within ``seconds``."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return received


def test_the_control_port_takes_tls_only(mesh: MeshProcesses) -> None:
    """A plaintext peer (one that speaks the frames without TLS) is dropped at once; a token whose
    CA fingerprint was changed makes the node refuse the coordinator before it sends anything."""
    with socket.create_connection(("127.0.0.1", mesh.control_port), timeout=10) as plain:
        plain.sendall(header(FrameType.CONTROL, 10) + b"{}" * 5)
        answer = _until_closed(plain, 10)
    assert answer is not None, "the coordinator kept a plaintext peer's connection open"
    assert MAGIC not in answer  # a TLS alert at most: never a challenge in the clear
    tampered = dataclasses.replace(Invite.decode(mesh.token), ca_fingerprint="ab" * 32).encode()
    assert_join_refused(mesh, tampered, "not the one this invite names")


def test_before_its_invite_is_proved_a_peer_gets_small_frames_and_little_time(
    mesh: MeshProcesses,
) -> None:
    """On the control port, before the join is proved: a control frame larger than the handshake
    cap, or any data frame, closes the connection before anything is read or allocated (eight
    such connections leave the coordinator's memory as it was), and a peer that stops mid-frame
    is dropped after the handshake deadline."""
    rss = psutil.Process(mesh.serve.pid).memory_info().rss  # type: ignore[union-attr]
    for kind, length in [(FrameType.CONTROL, 1 << 20)] * 4 + [(FrameType.HIDDEN, 255 << 20)] * 4:
        with _challenged(mesh) as sock:
            sock.sendall(header(kind, length) + b"x" * 1000)
            assert _closed_within(sock, 10) < 5
    grown = psutil.Process(mesh.serve.pid).memory_info().rss - rss  # type: ignore[union-attr]
    assert grown < 20 << 20, f"the coordinator grew by {grown >> 20} MB"
    with _challenged(mesh) as sock:
        sock.sendall(header(FrameType.CONTROL, 100) + b"{")  # and then nothing
        waited = _closed_within(sock, HANDSHAKE_DEADLINE_S + 10)
        assert HANDSHAKE_DEADLINE_S - 1 < waited < HANDSHAKE_DEADLINE_S + 5


def test_a_node_lost_with_no_spare_ends_the_request_with_a_clear_error_after_the_deadline(
    mesh: MeshProcesses,
) -> None:
    """The survivor cannot hold the model alone: the request waits for a node to join until the
    replay deadline, then ends naming the node lost and why the mesh could not serve again."""
    first, second = mesh.join("node0"), mesh.join("node1")
    mesh.wait_ready()
    began = time.monotonic()
    message = mesh.kill_mid_stream(second)
    assert (
        "node1 left the mesh" in message
        and f"could not serve again within {REPLAY_DEADLINE_S} s" in message
    )
    assert "cannot plan" in message, message
    assert REPLAY_DEADLINE_S <= time.monotonic() - began < REPLAY_DEADLINE_S + 30
    health = httpx.get(f"{mesh.base_url}/health", timeout=10)
    assert health.status_code == 503 and "node1" in health.json()["reason"]
    assert first.poll() is None  # the surviving node is still running


def test_requests_beyond_the_bound_are_refused_with_429_semantics() -> None:
    """The mesh backend holds at most ``max_requests`` in flight; one more is refused at once
    (OverloadedError: HTTP 429 `queue_full`), and a finished request makes room again. The
    coordinator here records what it is asked to send (no nodes are needed to count)."""
    import asyncio
    from types import SimpleNamespace

    from seamline.errors import OverloadedError
    from seamline.mesh.control.mesh_backend import MeshBackend
    from seamline.mesh.control.state_keeper import StateKeeper
    from seamline.params import SamplingParams

    sent: list[object] = []
    serving = threading.Event()
    serving.set()
    coordinator = SimpleNamespace(
        on_tokens=None,
        on_failure=None,
        open_request=lambda request, tokens: sent.append((request, tuple(tokens))),
        close_request=lambda request: sent.append(("close", request)),
        ready=serving,
        state="ready",
        plan_id=1,
        keeper=StateKeeper(),
    )
    backend = MeshBackend(coordinator, None, "m", 64, max_requests=2)  # type: ignore[arg-type]

    async def scenario() -> None:
        first, second = (
            backend.generate([1, 2], SamplingParams()),
            backend.generate([3], SamplingParams()),
        )
        waiting = [asyncio.ensure_future(anext(g)) for g in (first, second)]
        await asyncio.sleep(0.05)
        with pytest.raises(OverloadedError, match="2 requests are already in flight"):
            await anext(backend.generate([4], SamplingParams()))
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await first.aclose()
        await second.aclose()
        third = backend.generate([5], SamplingParams())
        task = asyncio.ensure_future(anext(third))
        await asyncio.sleep(0.05)
        assert not task.done()  # admitted: waiting for its first token
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    opened = [m[0].request for m in sent if m[0] != "close"]  # type: ignore[index, union-attr]
    assert len(set(opened)) == 3 and min(opened) > 1 << 20  # random 63-bit ids, not a counter
    assert {("close", r) for r in opened[:2]} <= set(sent)  # type: ignore[arg-type]


def test_torch_collectives_between_hosts_need_insecure_comm() -> None:
    """gloo and NCCL encrypt nothing: `--transport torch` across hosts is refused with the way
    out named; on one host it is fine; `auto` falls back to our TCP mesh across hosts."""
    from seamline.mesh.control.coordinator import StartupError, choose_transport

    one, two = {"10.0.0.1"}, {"10.0.0.1", "10.0.0.2"}
    assert choose_transport("torch", False, one, insecure_comm=False) == "torch"
    with pytest.raises(StartupError, match="--insecure-comm"):
        choose_transport("torch", True, two, insecure_comm=False)
    assert choose_transport("torch", True, two, insecure_comm=True) == "torch"
    assert (
        choose_transport("auto", True, one, insecure_comm=False) == "torch"
    )  # NCCL on one host's GPUs
    assert choose_transport("auto", True, two, insecure_comm=False) == "tcp"
    assert choose_transport("auto", True, two, insecure_comm=True) == "torch"
    assert choose_transport("auto", False, one, insecure_comm=False) == "tcp"
    assert choose_transport("tcp", True, two, insecure_comm=False) == "tcp"


def test_nccl_only_for_ranks_on_gpus_of_their_own() -> None:
    """NCCL takes one rank per GPU: two ranks on one host's one GPU, or a rank on a CPU, keep
    the group on the TCP mesh (whose gates copy to the host)."""
    from seamline.mesh.control.startup import gpus_apart

    assert gpus_apart([("10.0.0.1", "cuda:0"), ("10.0.0.1", "cuda:1")])
    assert gpus_apart([("10.0.0.1", "cuda:0"), ("10.0.0.2", "cuda:0")])
    assert not gpus_apart([("10.0.0.1", "cuda:0"), ("10.0.0.1", "cuda:0")])
    assert not gpus_apart([("10.0.0.1", "cuda:0"), ("10.0.0.1", "cpu")])


def test_a_node_leaves_a_coordinator_that_cannot_prove_the_invite(tmp_path: Path) -> None:
    """Whoever answers at the invite's address must prove it holds the invite's secret too (the
    node's own nonce, answered apart from the node's proof); one that cannot is refused with a
    clear error and the node exits."""
    import threading

    from seamline.mesh.protocol.invite import new_invite
    from seamline.net.link import Link, listen
    from seamline.net.messages import Challenge, Join, Welcome
    from tests.support.mesh_harness import join_once

    server = listen("127.0.0.1", 0)
    invite = new_invite(("127.0.0.1",), server.getsockname()[1], 1, ttl_s=60)

    def impostor() -> None:
        sock, _ = server.accept()
        link = Link(sock)
        link.send_message(Challenge(nonce="0123"))
        join = link.recv()
        assert isinstance(join, Join)
        link.send_message(
            Welcome(node_id=join.node_id, proof=join.proof)
        )  # the node's own answer, played back
        time.sleep(30)

    threading.Thread(target=impostor, daemon=True).start()
    out = join_once(invite.encode(), tmp_path)
    assert out.returncode != 0 and "did not prove it holds this invite" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    server.close()
