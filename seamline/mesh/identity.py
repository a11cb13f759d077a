"""The mesh's certificate authority and its members' identities (X.509, ECDSA P-256).

`seamline serve` keeps a CA in its state directory; it issues the coordinator's certificate and
every member's. A joining node makes its own key, proves its invite, and sends a certificate
signing request; the coordinator answers with a certificate naming the node id (the subject's
common name), valid for ``CERT_TTL_S`` and renewed while the node stays. Every link between
members is TLS 1.3 with both certificates verified against the CA, and the peer's node id is
checked against the plan. The invite carries the CA's fingerprint, so a joining node knows
the coordinator before it has a certificate of its own.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import secrets
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from seamline.errors import SeamlineError
from seamline.net.tls import mutual_context

COORDINATOR_ID = (
    "seamline-coordinator"  # the coordinator's name in its certificate; no node may take it
)
CERT_TTL_S = 3600.0  # a member's certificate; renewed at half its life
CA_TTL_DAYS = 3650


class IdentityError(SeamlineError):
    """A certificate or signing request that does not check out."""


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def fingerprint(certificate_pem: bytes | str) -> str:
    """sha256 of the certificate's DER, hex: what an invite pins."""
    pem = certificate_pem.encode() if isinstance(certificate_pem, str) else certificate_pem
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.decode())).hexdigest()


def signing_request(key: ec.EllipticCurvePrivateKey, node_id: str) -> str:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)])
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class MeshAuthority:
    """The CA: its key signs members' certificates. Kept as ``ca.key`` and ``ca.pem``."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate) -> None:
        self.key = key
        self.certificate = certificate
        self.ca_pem = certificate.public_bytes(serialization.Encoding.PEM).decode()
        self.fingerprint = fingerprint(self.ca_pem)

    @classmethod
    def load_or_create(cls, state_dir: Path) -> MeshAuthority:
        key_file, cert_file = state_dir / "ca.key", state_dir / "ca.pem"
        if key_file.is_file() and cert_file.is_file():
            key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
            assert isinstance(key, ec.EllipticCurvePrivateKey)
            return cls(key, x509.load_pem_x509_certificate(cert_file.read_bytes()))
        authority = cls.create()
        state_dir.mkdir(parents=True, exist_ok=True)
        _write_private(key_file, key_pem(authority.key))
        cert_file.write_text(authority.ca_pem)
        return authority

    @classmethod
    def create(cls) -> MeshAuthority:
        key = new_key()
        name = _name(f"seamline mesh CA {secrets.token_hex(4)}")
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - datetime.timedelta(minutes=5))
            .not_valid_after(_now() + datetime.timedelta(days=CA_TTL_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key, certificate)

    def issue(self, csr_pem: str, node_id: str, ttl_s: float = CERT_TTL_S) -> str:
        """A certificate for the key in ``csr_pem``, naming ``node_id`` (whatever the request
        names). A negative ``ttl_s`` issues one already expired (tests)."""
        try:
            csr = x509.load_pem_x509_csr(csr_pem.encode())
        except ValueError:
            raise IdentityError("the certificate signing request is not valid PEM") from None
        if not csr.is_signature_valid:
            raise IdentityError("the certificate signing request's signature does not check out")
        start = _now() - datetime.timedelta(minutes=5)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(node_id))
            .issuer_name(self.certificate.subject)
            .public_key(csr.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(
                min(
                    start,
                    _now() + datetime.timedelta(seconds=ttl_s) - datetime.timedelta(minutes=1),
                )
            )
            .not_valid_after(_now() + datetime.timedelta(seconds=ttl_s))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        return certificate.public_bytes(serialization.Encoding.PEM).decode()

    def identity(self, node_id: str, ttl_s: float = CERT_TTL_S) -> Identity:
        """A fresh key and certificate for ``node_id`` (the coordinator's own, or a test's)."""
        key = new_key()
        return Identity(
            node_id,
            key_pem(key).decode(),
            self.issue(signing_request(key, node_id), node_id, ttl_s),
            self.ca_pem,
        )


@dataclass(frozen=True)
class Identity:
    """A member's key and certificate, and the CA it trusts; makes its TLS contexts."""

    node_id: str
    key_pem: str
    certificate_pem: str
    ca_pem: str

    def expires(self) -> float:
        certificate = x509.load_pem_x509_certificate(self.certificate_pem.encode())
        return certificate.not_valid_after_utc.timestamp()

    def server_context(self, require_peer: bool = True) -> ssl.SSLContext:
        """Accepts TLS 1.3 only; a peer must present a certificate from the CA unless
        ``require_peer`` is False (the control port, where nodes come to get one)."""
        return self._context(True, require_peer)

    def client_context(self) -> ssl.SSLContext:
        """Dials TLS 1.3 and verifies the peer against the CA; its node id is checked by the
        caller against the plan (members are reached by address, not by a host name)."""
        return self._context(False, True)

    def _context(self, server_side: bool, require_peer: bool) -> ssl.SSLContext:
        with tempfile.TemporaryDirectory(
            prefix="seamline-tls-"
        ) as folder:  # ssl loads keys from files only
            cert_file, key_file = self.write(Path(folder), "member")
            return mutual_context(server_side, cert_file, key_file, self.ca_pem, require_peer)

    def write(self, folder: Path, name: str) -> tuple[Path, Path]:
        """``name.pem`` and ``name.key`` (private) in ``folder``."""
        cert_file, key_file = folder / f"{name}.pem", folder / f"{name}.key"
        cert_file.write_text(self.certificate_pem)
        _write_private(key_file, self.key_pem.encode())
        return cert_file, key_file


def enrolling_context() -> ssl.SSLContext:
    """A joining node's first dial, before it has a certificate: TLS 1.3, the coordinator's
    certificate checked afterwards against the invite's CA fingerprint (``check_coordinator``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def check_coordinator(leaf_der: bytes | None, ca_pem: str, pinned: str) -> None:
    """The CA the coordinator sent is the one the invite pins, and it issued the certificate
    the coordinator presented, which names the coordinator; IdentityError otherwise."""
    if not ca_pem or fingerprint(ca_pem) != pinned:
        raise IdentityError(
            "the coordinator's CA is not the one this invite names: not the mesh the token is for"
        )
    if leaf_der is None:
        raise IdentityError("the coordinator presented no certificate")
    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    leaf = x509.load_der_x509_certificate(leaf_der)
    try:
        leaf.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise IdentityError(
            f"the coordinator's certificate was not issued by the mesh CA ({exc})"
        ) from None
    names = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names or names[0].value != COORDINATOR_ID:
        raise IdentityError(
            "the certificate the coordinator presented does not name the coordinator"
        )
    now = _now()
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise IdentityError("the coordinator's certificate has expired")


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
