"""How a node becomes a member, and a member again after losing its coordinator; ``Node``
takes these methods.

A node joins with its invite (enrolling for a certificate over TLS, then attaching its control
link under it). When the coordinator goes away (restarted, or the link broke) a node keeps its
stage loaded and dials it again every few seconds under the certificate it holds (``Rejoin``):
a coordinator restarted with its state directory has the same CA and takes it back without a
new invite. That works while the certificate lasts (``CERT_TTL_S``, an hour); after that the
node stops and must join again with an invite.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from seamline.mesh.identity import COORDINATOR_ID, check_coordinator, enrolling_context
from seamline.mesh.node.credentials import Credentials
from seamline.mesh.protocol.fragment_server import PeerGate, serve_fragments
from seamline.mesh.protocol.invite import Invite, InviteError, coordinator_proof, proof
from seamline.model.devices import concrete_device, resolve_device
from seamline.net.frames import HANDSHAKE_DEADLINE_S, FrameError
from seamline.net.link import Link, LinkClosed, listen, listen_on_free_port, reserve_port
from seamline.net.messages import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    Challenge,
    DeviceResources,
    Holding,
    Join,
    Refuse,
    Rejoin,
    Renew,
    Resources,
    Welcome,
    node_id_refusal,
)
from seamline.net.tls import TlsRefused
from seamline.precision import int8_kernels_here
from seamline.runtime.openmp import on_passing_thread

if TYPE_CHECKING:
    from seamline.mesh.node.process import Node, NodeOptions

log = logging.getLogger("seamline.node")


class JoinRefused(InviteError):
    """The coordinator refused this node for good (removed from the mesh, say)."""


REJOIN_FIRST_S, REJOIN_MAX_S = 1.0, 15.0  # pauses between tries to reach a lost coordinator
DEVICE_PROBE_BYTES = (
    256 << 20
)  # a GPU's rate probe: a matrix this large, read a few dozen times (milliseconds)


def measure_rate(
    megabytes: int = 32, repeats: int = 7, pause_s: float = 0.02, retries: int = 6
) -> float:
    """Weight-streaming rate (bytes/s) of a matrix-vector product: decode is bound by it.

    The fastest of a few products spread over ~0.2 s, on all threads. Threads that share their
    cores with a busy neighbour (another node starting on the same host) wait for each other
    and run several times slower than one thread alone, so a rate on all threads below the
    one-thread rate is measured again, a little later, a few times, and never reported below
    the one-thread rate."""
    rows = megabytes * (1 << 20) // (4 * 1024)
    matrix, vector = torch.randn(rows, 1024), torch.randn(1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _fastest_mv(matrix, vector, repeats, pause_s)
    finally:
        torch.set_num_threads(threads)
    fastest = _fastest_mv(matrix, vector, repeats, pause_s)
    for _ in range(retries):
        if fastest <= alone:
            break
        time.sleep(0.25)
        fastest = min(fastest, _fastest_mv(matrix, vector, repeats, pause_s))
    return matrix.numel() * 4 / min(fastest, alone)


def _fastest_mv(matrix: torch.Tensor, vector: torch.Tensor, repeats: int, pause_s: float) -> float:
    torch.mv(matrix, vector)
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(matrix, vector)
        fastest = min(fastest, time.perf_counter() - start)
        time.sleep(pause_s)
    return fastest


def measure_device_rate(device: torch.device, free: int, repeats: int = 3, inner: int = 8) -> float:
    """Weight-streaming rate (bytes/s) of a matrix-vector product on a CUDA device, as
    ``measure_rate`` on the CPU: the fastest of a few timings of ``inner`` products over a
    ``DEVICE_PROBE_BYTES`` matrix (smaller where less is free), timed by the device itself."""
    rows = max(1, min(DEVICE_PROBE_BYTES, free // 4) // (4 * 1024))
    with torch.cuda.device(device):
        matrix, vector = torch.randn(rows, 1024, device=device), torch.randn(1024, device=device)
        torch.mv(matrix, vector)  # warm: cuBLAS picks its kernel
        fastest = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                torch.mv(matrix, vector)
            end.record()
            end.synchronize()
            fastest = min(fastest, start.elapsed_time(end) / 1e3 / inner)  # ms -> s, per product
        nbytes = matrix.numel() * 4
        del matrix, vector
        torch.cuda.empty_cache()  # give the probe's memory back to the device, not to torch's cache
    return nbytes / fastest


def local_devices(options: NodeOptions) -> list[DeviceResources]:
    """The CUDA devices this node may compute on, the one it computes on (``--device``) first:
    each one's free memory (at most ``--max-memory``) and measured rate. None on a machine
    without CUDA, or told to compute on its CPU."""
    if not torch.cuda.is_available():
        return []
    chosen = resolve_device(options.device)
    if chosen.type != "cuda":
        return []
    first = torch.cuda.current_device() if chosen.index is None else chosen.index
    order = [first, *(i for i in range(torch.cuda.device_count()) if i != first)]
    devices = []
    for index in order:
        device = torch.device("cuda", index)
        try:
            free = int(torch.cuda.mem_get_info(device)[0])  # before the probe takes any
            rate = measure_device_rate(device, free)
        except (
            RuntimeError
        ) as exc:  # torch.OutOfMemoryError too: the device is busy; plan without it
            log.warning("%s not reported: its rate probe failed (%s)", device, exc)
            continue
        if options.max_memory_bytes is not None:  # --max-memory caps what it may use there too
            free = min(free, options.max_memory_bytes)
        devices.append(
            DeviceResources(device=str(device), free_memory_bytes=free, bytes_per_second=rate)
        )
    return devices


def local_resources(options: NodeOptions) -> Resources:
    free = psutil.virtual_memory().available
    if options.max_memory_bytes is not None:
        free = min(free, options.max_memory_bytes)
    device = str(
        concrete_device(resolve_device(options.device))
    )  # picks a lockstep group's transport
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return Resources(
        free_memory_bytes=int(free),
        bytes_per_second=on_passing_thread(measure_rate, "seamline-measure"),
        device=device,
        cores=os.cpu_count() or 1,
        host=_boot_id(),
        cpus=cpus,
        int8_kernels=int8_kernels_here(),
        devices=local_devices(options),
    )


def _boot_id() -> str:
    """This boot of this machine (shared by its containers and network namespaces, which
    share its CPUs); "" where the kernel does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def connect_to_coordinator(invite: Invite, tls: ssl.SSLContext | None = None) -> Link:
    """A link to the control port: TLS when the invite pins a mesh CA, under ``tls`` (this node's
    certificate) or, to enroll, with the coordinator's certificate checked once the coordinator
    has sent the CA (``check_coordinator``)."""
    errors = []
    tls = tls or (enrolling_context() if invite.ca_fingerprint else None)
    for host in invite.hosts:
        try:
            return Link.connect(host, invite.control_port, name=f"coordinator {host}", tls=tls)
        except OSError as exc:
            errors.append(f"{host}:{invite.control_port}: {exc}")
    raise InviteError(f"cannot reach the coordinator ({'; '.join(errors)})")


class Membership:
    """Joining and rejoining; mixed into ``Node``."""

    def join(self: Node) -> None:
        if bad := node_id_refusal(self.options.node_id):
            raise InviteError(f"{bad} (--node-id)")
        self.invite.check_fresh()
        self.control = control = connect_to_coordinator(self.invite)
        try:
            self._join(control)
            if (
                self.credentials is not None
            ):  # enrolled: the control link proper, under our certificate
                control.close()
                self.control = self._attach()
                self.credentials.keep_renewed(lambda csr: self._send_control(Renew(csr=csr)))
        except (LinkClosed, FrameError) as exc:
            control.close()
            raise InviteError(
                f"the coordinator ended the join: {exc} (is the token this mesh's, in full?)"
            ) from None

    def _attach(self: Node, rejoin: Join | None = None) -> Link:
        """The control link proper, under this node's certificate: attached right after
        enrolling, or ``rejoin``-ing a coordinator that lost this node."""
        assert self.credentials is not None and self.credentials.client is not None
        link = connect_to_coordinator(self.invite, self.credentials.client)
        if (
            not isinstance(link.recv(deadline_s=HANDSHAKE_DEADLINE_S), Challenge)
            or link.peer_id() != COORDINATOR_ID
        ):
            link.close()
            raise InviteError(f"{link.name} is not the coordinator that enrolled this node")
        link.send_message(Rejoin(join=rejoin) if rejoin else Attach(node_id=self.options.node_id))
        answer = link.recv(deadline_s=HANDSHAKE_DEADLINE_S)
        if not isinstance(answer, Attached):
            link.close()
            error = JoinRefused if isinstance(answer, Refuse) and answer.final else InviteError
            raise error(
                f"the coordinator did not take this node's control link: {getattr(answer, 'reason', answer)}"
            )
        return link

    def _join(self: Node, control: Link) -> None:
        challenge = control.recv()
        if not isinstance(challenge, Challenge):
            raise InviteError(f"coordinator sent {type(challenge).__name__} instead of a challenge")
        if self.invite.ca_fingerprint:
            check_coordinator(
                control.sock.peer_certificate_der(),
                challenge.ca_certificate,  # type: ignore[union-attr]
                self.invite.ca_fingerprint,
            )
            self.credentials = Credentials(self.options.node_id, challenge.ca_certificate)
        data_host = control.sock.getsockname()[0]
        self.data_server = listen(data_host, self.options.data_port)
        if self.comm_reservation is not None:  # joining again: the port is drawn anew
            self.comm_reservation.close()
        # held for the node's life: no other process may take the port its lockstep peers dial
        self.comm_reservation = reserve_port(data_host)
        self.comm_port = self.comm_reservation.getsockname()[1]
        # listening before the coordinator hears of it: no other process can draw the port meanwhile
        fragments = listen_on_free_port(data_host) if self.credentials else None
        fragments_port = fragments.getsockname()[1] if fragments is not None else 0
        nonce = secrets.token_hex(16)
        join = Join(
            node_id=self.options.node_id,
            proof=proof(self.invite.secret, challenge.nonce),
            nonce=nonce,
            invite_id=self.invite.id,
            protocol_version=PROTOCOL_VERSION,
            resources=local_resources(self.options),
            data_host=data_host,
            data_port=self.data_server.getsockname()[1],
            max_memory_bytes=self.options.max_memory_bytes,
            comm_port=self.comm_port,
            fragments_port=fragments_port,
            csr=self.credentials.signing_request() if self.credentials else "",
        )
        try:
            control.send_message(join)
            self.joined_as = join
            self._welcomed(control, nonce)
        except BaseException:
            if fragments is not None:
                fragments.close()
            raise
        if fragments is not None:  # a mesh with TLS: members fetch this node's fragments
            self._serve_fragments(fragments)
        log.info("joined as %s; data port %s:%d", self.options.node_id, data_host, join.data_port)

    def _welcomed(self: Node, control: Link, nonce: str) -> None:
        """Take the coordinator's answer to this node's join: its welcome, proved and with this
        node's certificate where the mesh has TLS; else raise ``InviteError``."""
        answer = control.recv()
        if isinstance(answer, Refuse):
            raise InviteError(f"coordinator refused this node: {answer.reason}")
        if not isinstance(answer, Welcome):
            raise InviteError(f"coordinator sent {type(answer).__name__} instead of a welcome")
        if not hmac.compare_digest(answer.proof, coordinator_proof(self.invite.secret, nonce)):
            raise InviteError(
                "the coordinator did not prove it holds this invite: not the mesh the token names"
            )
        if self.credentials is not None:
            self.credentials.accept(answer.certificate)

    def _serve_fragments(self: Node, listener: socket.socket) -> None:
        """Serve the fragments this node holds (its stage folder, and its cache) to members: mutual TLS under
        its certificate is the only key, so a peer that is no member is refused at the handshake,
        and a removed one (``Revoked``) by the gate. (A renewed certificate is not taken up here:
        once the first expires, members fetch from the coordinator.)"""
        assert self.credentials is not None and self.credentials.identity is not None
        folder = self.options.cache_dir / "stages" / self.options.node_id
        # a private mesh's ends serve no member: their folders hold the embedding and the head
        self.fragment_gate = PeerGate(lambda peer: peer in self.revoked or self.tail is not None)
        host, port = listener.getsockname()[:2]
        serve_fragments(
            folder,
            lambda _token: True,
            host,
            port,
            self.credentials.identity.server_context(),
            self.fragment_gate,
            held=self.options.cache_dir / "fragments",
            listener=listener,
        )

    def _holding(self: Node) -> Holding | None:
        """The stage this node has loaded, which a restarted coordinator may keep (a lockstep
        rank's share is re-formed with its group instead)."""
        held = self.assignment
        if (
            held is None
            or self.worker is None
            or self.group_stage is not None
            or held.shard != (0, 1)
            or held.tail
        ):
            return None
        return Holding.of(held)

    def rejoin(self: Node) -> bool:
        """The coordinator is gone: dial it again under this node's certificate, a few seconds
        apart, keeping the stage loaded, until it takes the node back (True) or the certificate
        expires (False: the node must join again with an invite)."""
        if self.credentials is None or self.credentials.identity is None or self.joined_as is None:
            return False
        pause = REJOIN_FIRST_S
        while self.credentials.identity.expires() > time.time():
            try:
                self.control = self._attach(
                    rejoin=self.joined_as.model_copy(update={"holding": self._holding()})
                )
                log.info("the coordinator took this node back")
                return True
            except JoinRefused as exc:
                log.error("%s: node stops", exc)
                return False
            except (InviteError, OSError, LinkClosed, FrameError, TlsRefused) as exc:
                log.info("the coordinator is not back (%s); trying again in %.0f s", exc, pause)
            time.sleep(pause)
            pause = min(REJOIN_MAX_S, pause * 2)
        log.error(
            "this node's certificate expired before the coordinator came back: join again with an invite"
        )
        return False
