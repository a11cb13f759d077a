"""Peers that speak a mesh's TLS, for tests that play a member, an impostor or a stranger."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from seamline.mesh.identity import Identity, MeshAuthority, enrolling_context
from seamline.net.link import Link, tune
from seamline.net.tls import TlsSocket


def mesh_authority(root: Path) -> MeshAuthority:
    """The CA a test mesh's coordinator keeps (its SEAMLINE_CACHE is ``root / "coordinator"``)."""
    return MeshAuthority.load_or_create(root / "coordinator" / "mesh")


def member(root: Path, node_id: str, ttl_s: float = 600.0) -> Identity:
    """A certificate the mesh's CA issued for ``node_id``: what a member holds."""
    return mesh_authority(root).identity(node_id, ttl_s)


def tls_link(
    address: tuple[str, int], identity: Identity | None = None, trusting: bool = False
) -> Link:
    """A TLS link to ``address``, presenting ``identity`` (None: no certificate, as a joining
    node); ``trusting``: the client accepts any server certificate, so the test sees how the
    server answers a certificate it should refuse."""
    context = identity.client_context() if identity is not None else enrolling_context()
    if trusting:
        context.verify_mode = ssl.CERT_NONE
    return Link.connect(*address, tls=context)


def tls_socket(address: tuple[str, int], identity: Identity | None = None) -> TlsSocket:
    sock = tune(socket.create_connection(address, timeout=10))
    context = identity.client_context() if identity is not None else enrolling_context()
    return TlsSocket.handshake(sock, context, False, 10)
