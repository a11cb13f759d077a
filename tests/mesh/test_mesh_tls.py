"""Mutual TLS: a mesh answers as before with nothing readable on its links; lockstep comms verify
every rank's certificate; a coordinator that is not the invite's mesh is refused."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from seamline.app import LocalModel
from seamline.mesh.identity import COORDINATOR_ID, Identity, MeshAuthority
from seamline.mesh.protocol.invite import new_invite
from seamline.net.frames import EMPTY_HASH, MAGIC, HiddenFrame, Row
from seamline.net.link import Link, listen
from seamline.net.messages import Challenge
from seamline.net.tls import GroupTls
from seamline.parallel import CommError, GateTag
from seamline.parallel.tcp_comm import TcpComm
from seamline.server.demo import memory_cap_gb
from seamline_bench.tls_hop import link_pair
from tests.support.mesh import ask, expected_text
from tests.support.mesh_harness import MeshProcesses, join_once

CONTEXT = 1024
QUESTION = "Name three rivers in Europe and one fact about each."


class RecordingProxy:
    """Forwards every connection to ``target`` and keeps every byte that crossed it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = listen("127.0.0.1", 0)
        self.port = int(self.server.getsockname()[1])
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self.server.accept()
            except OSError:
                return
            outside = socket.create_connection(self.target)
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def test_a_mesh_over_tls_answers_as_one_process_with_nothing_in_the_clear(tmp_path: Path) -> None:
    """Two nodes join through a proxy that records their control links, which carry every prompt's
    token ids and every generated token: the mesh's greedy text equals one process's, and the
    recording holds no frame header, no message field and no token id list in the clear."""
    import dataclasses

    from seamline.mesh.protocol.invite import Invite

    model = LocalModel.load(context=CONTEXT)
    mesh = MeshProcesses(
        tmp_path,
        nodes=2,
        node_memory_gb=memory_cap_gb(None, 2, CONTEXT),
        serve_args=("--context", str(CONTEXT)),
    ).start(join=False)
    proxy = RecordingProxy(("127.0.0.1", mesh.control_port))
    try:
        through_proxy = dataclasses.replace(
            Invite.decode(mesh.token), control_port=proxy.port
        ).encode()
        for node in ("node0", "node1"):
            mesh.join(node, token=through_proxy)
        status = mesh.wait_ready()
        assert len(status["stages"]) == 2, status
        reply = ask(mesh, QUESTION, 24)
        assert reply["choices"][0]["message"]["content"] == expected_text(model, QUESTION, 24)
    finally:
        mesh.stop()
        proxy.close()
    ids = model.codec.encode_chat([{"role": "user", "content": QUESTION}])
    seen = bytes(proxy.seen)
    assert len(seen) > 10_000  # the recording did capture the links' traffic
    for clear in (
        MAGIC,
        b'"kind"',
        b'"tokens"',
        b"prompt",
        ", ".join(map(str, ids[:6])).encode(),
        ",".join(map(str, ids[:6])).encode(),
    ):
        assert clear not in seen, clear


def _group(
    identities: list[Identity],
    names: tuple[str, ...],
    run: Callable[[TcpComm, int], object],
    timeout_s: float = 10.0,
) -> list[object]:
    """Run a 2-rank TcpComm over TLS on threads; each rank's result, or the exception it raised."""
    ports = [listen("127.0.0.1", 0) for _ in identities]
    addresses = [("127.0.0.1", int(p.getsockname()[1])) for p in ports]
    for p in ports:
        p.close()
    results: list[object] = [None] * len(identities)

    def rank(r: int) -> None:
        tls = GroupTls(identities[r].server_context(), identities[r].client_context(), names)
        try:
            comm = TcpComm.connect(
                r, len(identities), addresses, timeout_s, "fp", connect_timeout_s=timeout_s, tls=tls
            )
            results[r] = run(comm, r)
            comm.close()
        except Exception as exc:  # the test reads it
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(identities))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 3)
    return results


def test_lockstep_comm_over_mutual_tls_sums_and_refuses_the_wrong_certificate() -> None:
    """Two ranks with certificates from one CA sum a small and a large (threaded-send) partial
    exactly; a rank whose certificate names another node than the plan's, or one from another
    CA, is refused with the reason."""
    ca = MeshAuthority.create()
    names = ("node0", "node1")

    def sums(comm: TcpComm, r: int) -> list[torch.Tensor]:
        small = torch.full((4, 8), float(r + 1))
        large = torch.arange(1 << 18, dtype=torch.float32) * (r + 1)
        return [comm.all_reduce(small, GateTag(0, 0, 1)), comm.all_reduce(large, GateTag(0, 1, 2))]

    good = _group([ca.identity("node0"), ca.identity("node1")], names, sums)
    for result in good:
        assert isinstance(result, list), result
        assert torch.equal(result[0], torch.full((4, 8), 3.0))
        assert torch.equal(result[1], torch.arange(1 << 18, dtype=torch.float32) * 3)
    wrong_name = _group([ca.identity("node0"), ca.identity("mallory")], names, sums, timeout_s=5)
    assert isinstance(wrong_name[0], CommError) and "'mallory'" in str(wrong_name[0]), wrong_name
    foreign = _group(
        [ca.identity("node0"), MeshAuthority.create().identity("node1")], names, sums, timeout_s=5
    )
    assert all(isinstance(r, CommError) for r in foreign), foreign
    assert any("refused" in str(r) for r in foreign), foreign


def test_a_node_refuses_a_coordinator_whose_certificate_another_ca_issued(tmp_path: Path) -> None:
    """The invite pins the mesh CA: whoever answers at its address with a certificate from
    another CA (while sending the real CA's certificate) is refused before the node sends its
    join, with a clear error."""
    real = MeshAuthority.create()
    impostor = MeshAuthority.create().identity(COORDINATOR_ID)
    server = listen("127.0.0.1", 0)
    invite = new_invite(
        ("127.0.0.1",), server.getsockname()[1], 1, ttl_s=60, ca_fingerprint=real.fingerprint
    )
    joined: list[object] = []

    def answer() -> None:
        sock, _ = server.accept()
        from seamline.net.tls import TlsSocket

        link = Link(
            TlsSocket.handshake(sock, impostor.server_context(require_peer=False), True, 10)
        )
        link.send_message(Challenge(nonce="0123", ca_certificate=real.ca_pem))
        try:
            joined.append(link.recv(deadline_s=20))
        except Exception as exc:  # the node hangs up: what should happen
            joined.append(exc)

    threading.Thread(target=answer, daemon=True).start()
    out = join_once(invite.encode(), tmp_path)
    assert out.returncode != 0 and "not issued by the mesh CA" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    deadline = time.monotonic() + 10
    while not joined and time.monotonic() < deadline:
        time.sleep(0.05)
    assert joined and isinstance(joined[0], Exception), (
        joined
    )  # no Join (with its proof) reached the impostor
    server.close()


def test_an_expired_member_certificate_cannot_join_a_group() -> None:
    ca = MeshAuthority.create()
    results = _group(
        [ca.identity("node0"), ca.identity("node1", ttl_s=-60)],
        ("node0", "node1"),
        lambda comm, r: comm.all_reduce(torch.ones(2), GateTag(0, 0, 1)),
        timeout_s=5,
    )
    assert all(isinstance(r, CommError) for r in results), results
    assert any("expired" in str(r) for r in results), results


def test_frames_of_every_size_cross_a_tls_link_intact_in_order() -> None:
    """Small frames go as one TLS record (header and payload sealed together), large ones as
    many; a reader and a writer share each end. Every frame arrives whole and in order."""
    sender, receiver = link_pair(MeshAuthority.create())
    sizes = [1, 3, 1000, 4095, 4096, 4097, 70_000, 2, 300_000, 5]
    sent = [torch.randn(1, n) for n in sizes]
    row = Row(request=1, position=0, count=1, hash_before=EMPTY_HASH, hash_after=1, flags=0)
    writer = threading.Thread(target=lambda: [sender.send_hidden([row], t) for t in sent])
    writer.start()
    try:
        for tensor in sent:
            frame = receiver.recv(deadline_s=10)
            assert isinstance(frame, HiddenFrame) and torch.equal(frame.tensor, tensor)
    finally:
        writer.join()
        sender.close()
        receiver.close()
