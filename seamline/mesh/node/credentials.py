"""A node's identity in the mesh: its key, the certificate the coordinator issued for it, and the
TLS contexts made from them. Renewed at half the certificate's life over the control link;
links already made keep running, new ones use the fresh certificate."""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric import ec

from seamline.mesh.identity import Identity, IdentityError, key_pem, new_key, signing_request

log = logging.getLogger("seamline.node")


class Credentials:
    def __init__(self, node_id: str, ca_pem: str) -> None:
        self.node_id = node_id
        self.ca_pem = ca_pem
        self._key = new_key()
        self.identity: Identity | None = None
        self.server: ssl.SSLContext | None = (
            None  # the data and comm ports: peers must present a certificate
        )
        self.client: ssl.SSLContext | None = None  # dialling peers
        self._renewed = threading.Event()

    def signing_key(self) -> ec.EllipticCurvePrivateKey:
        """This node's key, its certificate's: it signs the node's frames too (``frame_signing``)."""
        return self._key

    def signing_request(self) -> str:
        return signing_request(self._key, self.node_id)

    def accept(self, certificate_pem: str) -> None:
        """Take a certificate the coordinator issued for this node's key."""
        identity = Identity(self.node_id, key_pem(self._key).decode(), certificate_pem, self.ca_pem)
        try:
            server, client = identity.server_context(), identity.client_context()
        except ssl.SSLError as exc:  # not for our key, or not from the CA
            raise IdentityError(
                f"the coordinator sent a certificate that does not fit this node: {exc}"
            ) from None
        self.identity, self.server, self.client = identity, server, client
        self._renewed.set()

    def keep_renewed(self, ask: Callable[[str], None]) -> threading.Thread:
        """A thread that asks (``ask(csr)``) for a new certificate at half the current one's life."""

        def loop() -> None:
            while self.identity is not None and (left := self.identity.expires() - time.time()) > 0:
                time.sleep(max(1.0, left / 2))
                self._renewed.clear()
                try:
                    ask(self.signing_request())
                except (
                    Exception
                ) as exc:  # the coordinator is away: asked again, until the certificate expires
                    log.warning("cannot renew this node's certificate now: %s", exc)
                    continue
                if not self._renewed.wait(timeout=max(1.0, left / 4)):
                    log.error("the coordinator did not renew this node's certificate")

        thread = threading.Thread(target=loop, name="seamline-renew", daemon=True)
        thread.start()
        return thread
