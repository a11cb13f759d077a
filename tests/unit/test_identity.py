"""Member certificates: the CA names the node whatever its request says, a member renews its
certificate at half its life, and a coordinator is checked against the invite's pinned CA."""

from __future__ import annotations

import threading
import time

import pytest

from seamline.mesh.identity import (
    COORDINATOR_ID,
    IdentityError,
    MeshAuthority,
    check_coordinator,
    fingerprint,
    new_key,
    signing_request,
)
from seamline.mesh.node.credentials import Credentials
from seamline.net.tls import certificate_name


def test_the_ca_names_the_node_it_admitted_not_the_one_asked_for() -> None:
    ca = MeshAuthority.create()
    issued = ca.issue(signing_request(new_key(), "seamline-coordinator"), "node7")
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(issued.encode())
    assert cert.subject.rfc4514_string() == "CN=node7"
    with pytest.raises(IdentityError):
        ca.issue(
            "-----BEGIN CERTIFICATE REQUEST-----\nnot one\n-----END CERTIFICATE REQUEST-----", "x"
        )
    assert certificate_name({"subject": ((("commonName", "node7"),),)}) == "node7"


def test_a_member_renews_its_certificate_at_half_its_life() -> None:
    ca = MeshAuthority.create()
    credentials = Credentials("node1", ca.ca_pem)
    credentials.accept(ca.issue(credentials.signing_request(), "node1", ttl_s=4.0))
    first = credentials.identity
    assert first is not None
    asked: list[str] = []

    def ask(csr: str) -> None:  # the coordinator answers on the control link
        asked.append(csr)
        threading.Thread(
            target=lambda: credentials.accept(ca.issue(csr, "node1", ttl_s=3600))
        ).start()

    began = time.monotonic()
    credentials.keep_renewed(ask)
    while not asked and time.monotonic() - began < 10:
        time.sleep(0.05)
    assert (
        asked and 1.0 <= time.monotonic() - began < 4.0
    )  # at about half of 4 s, before it expires
    deadline = time.monotonic() + 5
    while credentials.identity is first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (
        credentials.identity is not first
        and credentials.identity.expires() > first.expires() + 3000
    )
    assert credentials.server is not None and credentials.client is not None


def test_a_coordinator_is_known_by_the_pinned_ca() -> None:
    import ssl

    real, other = MeshAuthority.create(), MeshAuthority.create()
    leaf = ssl.PEM_cert_to_DER_cert(real.identity(COORDINATOR_ID).certificate_pem)
    check_coordinator(leaf, real.ca_pem, real.fingerprint)  # the real one passes
    with pytest.raises(IdentityError, match="not the one this invite names"):
        check_coordinator(leaf, other.ca_pem, real.fingerprint)
    with pytest.raises(IdentityError, match="not issued by the mesh CA"):
        check_coordinator(
            ssl.PEM_cert_to_DER_cert(other.identity(COORDINATOR_ID).certificate_pem),
            real.ca_pem,
            real.fingerprint,
        )
    with pytest.raises(IdentityError, match="does not name the coordinator"):
        check_coordinator(
            ssl.PEM_cert_to_DER_cert(real.identity("node1").certificate_pem),
            real.ca_pem,
            fingerprint(real.ca_pem),
        )
