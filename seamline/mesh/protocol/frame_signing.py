"""Signed frames: in a mesh that checks its members (``--verify-fraction``), each stage signs
what it sends downstream with its link identity (the key of its mesh certificate).

A HIDDEN frame's statement is the digest (``runtime.digest``) of each of its rows, signed over
(the plan's digest seed, the sender's node id, each row's request, position and count, the
digests). The receiver checks the signature against the certificate of the link the frame came
on, and each row's digest against the rows' bytes as it got them, before it computes anything:
a frame that fails either is refused (its requests replay). So every frame a stage computes on
carries its sender's signature over what it holds, and the stage reports that signature with its
digests. When the coordinator finds two stages disagreeing about what crossed between them, the
signature says who: a sender cannot deny what it signed, and a receiver cannot show a signature
its sender never made.

A sender that signs one thing and sends another gains nothing: its frame is refused, and
nothing is computed from it. What it sent cannot be shown to anyone else (the receiver could
have made the bytes up), so that refusal blames no one: it costs a replay.
"""

from __future__ import annotations

import base64
import struct
from typing import NamedTuple

import torch
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from seamline.net.messages import Receipt
from seamline.runtime import digest

DOMAIN = b"seamline signed frame v1\0"
ROW_KEY = struct.Struct("<QII")  # request, position, count

Rows = list[tuple[int, int, int]] | tuple[tuple[int, int, int], ...]


class Signed(NamedTuple):
    """A frame's statement: its rows' digests ([rows, DIGEST_WIDTH] float32 bytes) and the
    sender's signature over them (a tuple, as ``frames.HiddenFrame.signed`` carries it)."""

    digests: bytes
    signature: bytes

    def digest_rows(self, rows: int) -> torch.Tensor:
        """The digests as [rows, DIGEST_WIDTH]; ValueError when they are not that many."""
        if len(self.digests) != rows * digest.DIGEST_WIDTH * 4:
            raise ValueError(f"{len(self.digests)} bytes of digests for {rows} rows")
        return torch.frombuffer(bytearray(self.digests), dtype=torch.float32).view(rows, -1)


def statement(seed: int, sender: str, rows: Rows, digests: bytes) -> bytes:
    """The bytes a frame's signature covers."""
    name = sender.encode()
    keys = b"".join(ROW_KEY.pack(*row) for row in rows)
    return DOMAIN + struct.pack("<QH", seed & (2**64 - 1), len(name)) + name + keys + digests


def sign(
    key: ec.EllipticCurvePrivateKey, seed: int, sender: str, rows: Rows, digests: torch.Tensor
) -> Signed:
    """Sign ``digests`` ([rows, DIGEST_WIDTH]) of ``rows`` as ``sender``."""
    raw = digests.contiguous().float().numpy().tobytes()
    signature = key.sign(statement(seed, sender, rows, raw), ec.ECDSA(hashes.SHA256()))
    return Signed(raw, signature)


def public_key_of(certificate_der: bytes | None) -> ec.EllipticCurvePublicKey | None:
    """The EC public key of a DER certificate (None: none, or not an EC key)."""
    if not certificate_der:
        return None
    key = x509.load_der_x509_certificate(certificate_der).public_key()
    return key if isinstance(key, ec.EllipticCurvePublicKey) else None


def signed_by(
    key: ec.EllipticCurvePublicKey, seed: int, sender: str, rows: Rows, signed: Signed
) -> bool:
    """Whether ``sender``'s ``key`` signed ``signed`` for ``rows`` under ``seed``."""
    try:
        key.verify(
            signed.signature,
            statement(seed, sender, rows, signed.digests),
            ec.ECDSA(hashes.SHA256()),
        )
    except InvalidSignature:
        return False
    return True


def frame_refusal(
    key: ec.EllipticCurvePublicKey | None,
    seed: int,
    sender: str,
    rows: Rows,
    tensor: torch.Tensor,
    signed: Signed | None,
) -> str:
    """Why a receiver refuses a HIDDEN frame of ``rows`` and ``tensor`` ("" when it is signed by
    ``sender`` and each row's bytes are what the signature says)."""
    if key is None:
        return f"no certificate of {sender}'s to check its signature with"
    if signed is None:
        return f"{sender} sent it unsigned"
    try:
        claimed = signed.digest_rows(len(rows))
    except ValueError as exc:
        return f"its statement is malformed: {exc}"
    if not signed_by(key, seed, sender, rows, signed):
        return f"its signature is not {sender}'s"
    offset = 0
    for (_, position, count), said in zip(rows, claimed):
        got = tensor[offset : offset + count]
        offset += count
        gap = digest.differs(
            digest.digest(got, position, seed),
            said,
            digest.scale(got, position, seed),
            torch.float32,
        )
        if gap > 1:
            return f"the rows it holds are not what {sender} signed (position {position})"
    return ""


def from_receipt(receipt: Receipt) -> tuple[list[tuple[int, int, int]], Signed]:
    """A reported receipt's rows and statement; ValueError when it is malformed."""
    try:
        signed = Signed(
            base64.b64decode(receipt.digests, validate=True),
            base64.b64decode(receipt.signature, validate=True),
        )
    except ValueError as exc:
        raise ValueError(f"a malformed receipt: {exc}") from None
    rows = [tuple(row) for row in receipt.rows]
    signed.digest_rows(len(rows))
    return rows, signed  # type: ignore[return-value]
