"""Certificates for members: the coordinator's side of ``mesh.identity``.

The control port speaks TLS with the coordinator's certificate; a joining node has none yet,
so the port does not ask for one. Its Challenge carries the CA (which the invite pins); a Join
that proves the invite carries a signing request, and the Welcome the node's certificate. A
member renews over its control link; a removed member's id is refused from then on (kept in the
state directory, so a restarted coordinator refuses it too).
"""

from __future__ import annotations

import json
import ssl
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from seamline.mesh.identity import (
    CERT_TTL_S,
    COORDINATOR_ID,
    IdentityError,
    MeshAuthority,
)
from seamline.net.messages import Challenge, Join


class Enrollment:
    def __init__(
        self,
        authority: MeshAuthority,
        cert_ttl_s: float = CERT_TTL_S,
        removed_file: Path | None = None,
    ) -> None:
        self.authority = authority
        self.cert_ttl_s = cert_ttl_s
        self.identity = authority.identity(COORDINATOR_ID, ttl_s=max(cert_ttl_s, 24 * 3600))
        self.control_context: ssl.SSLContext = self.identity.server_context(require_peer=False)
        self._removed_file = removed_file
        self.removed: set[str] = (
            set(json.loads(removed_file.read_text()))
            if removed_file and removed_file.is_file()
            else set()
        )
        self._keys: dict[str, list[ec.EllipticCurvePublicKey]] = {}  # every key certified, by node
        self._lock = threading.Lock()

    def challenge(self, nonce: str) -> Challenge:
        return Challenge(nonce=nonce, ca_certificate=self.authority.ca_pem)

    def refusal(self, join: Join) -> str:
        """Why this (invite-proving) join gets no certificate; "" when it does."""
        if join.node_id == COORDINATOR_ID:
            return f"{COORDINATOR_ID} is the coordinator's own name"
        with self._lock:
            if join.node_id in self.removed:
                return f"node {join.node_id} was removed from this mesh"
        if not join.csr:
            return "the join carries no certificate signing request (this mesh runs over TLS)"
        return ""

    def certify(self, node_id: str, csr: str) -> str:
        """A certificate for ``node_id``'s key; IdentityError if the request is bad or the node removed."""
        with self._lock:
            if node_id in self.removed:
                raise IdentityError(f"node {node_id} was removed from this mesh")
        certificate = self.authority.issue(csr, node_id, self.cert_ttl_s)
        key = x509.load_pem_x509_certificate(certificate.encode()).public_key()
        if isinstance(key, ec.EllipticCurvePublicKey):
            with self._lock:
                held = self._keys.setdefault(node_id, [])
                if key not in held:
                    held.append(key)
        return certificate

    def keys_of(self, node_id: str) -> list[ec.EllipticCurvePublicKey]:
        """Every key certified for ``node_id`` (a restarted node has a new one): what signs its
        frames (``frame_signing``), kept after it left, since a check may come after."""
        with self._lock:
            return list(self._keys.get(node_id, ()))

    def remove(self, node_id: str) -> None:
        with self._lock:
            self.removed.add(node_id)
            if self._removed_file is not None:
                self._removed_file.write_text(json.dumps(sorted(self.removed)))

    def is_removed(self, node_id: str) -> bool:
        with self._lock:
            return node_id in self.removed

    def removed_ids(self) -> list[str]:
        with self._lock:
            return sorted(self.removed)
