"""Signed frames: in a mesh that checks its members (``--verify-fraction``), each stage signs
what it sends downstream with its link identity (the key of its mesh certificate).

A HIDDEN frame's statement is, for each of its rows, the digest (``runtime.digest``) and the
SHA-256 of the row's bytes as sent, signed over (the plan's digest seed, the sender's node id,
each row's request, position and count, the digests, the hashes). The receiver checks the
signature against the certificate of the link the frame came on, and each row's hash and digest
against the rows' bytes as it got them, before it computes anything: a frame that fails any is
refused (its requests replay). So every frame a stage computes on
carries its sender's signature over what it holds, and the stage reports that signature with its
digests. When the coordinator finds two stages disagreeing about what crossed between them, the
signature says who: a sender cannot deny what it signed, and a receiver cannot show a signature
its sender never made.

A sender that signs a row's hash but a digest its bytes do not make has signed its own
contradiction: the receiver shows the coordinator the row's bytes with the statement
(``FrameProof``), and anyone can check that the bytes hash as signed and digest otherwise
(``proves_lie``): the sender is removed. A sender that signs one thing and sends bytes that do
not hash as signed gains nothing either: its frame is refused, and nothing is computed from it.
Those bytes cannot be shown to anyone else (the receiver could have made them up), so that
refusal blames no one: it costs a replay.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import NamedTuple

import torch
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from seamline.net.messages import FrameProof, Receipt
from seamline.runtime import digest

DOMAIN = b"seamline signed frame v2\0"
ROW_KEY = struct.Struct("<QII")  # request, position, count
DIGEST_BYTES = digest.DIGEST_WIDTH * 4  # a row's digest: float32
HASH_BYTES = 32  # a row's SHA-256
# A frame's rows a receiver takes (stage 0 runs at most 256 sequences): its statement must fit
# the receiver's report (``node.checks.digest_reporter``) on a member's control link.
MAX_SIGNED_ROWS = 256

Rows = list[tuple[int, int, int]] | tuple[tuple[int, int, int], ...]


class Signed(NamedTuple):
    """A frame's statement: its rows' digests ([rows, DIGEST_WIDTH] float32 bytes) then their
    SHA-256s (rows x 32 bytes), and the sender's signature over them (a tuple, as
    ``frames.HiddenFrame.signed`` carries it)."""

    digests: bytes  # the body: digests, then hashes
    signature: bytes

    def digest_rows(self, rows: int) -> torch.Tensor:
        """The digests as [rows, DIGEST_WIDTH]; ValueError when the body is not for ``rows``."""
        if len(self.digests) != rows * (DIGEST_BYTES + HASH_BYTES):
            raise ValueError(f"a statement of {len(self.digests)} bytes for {rows} rows")
        raw = bytearray(self.digests[: rows * DIGEST_BYTES])
        return torch.frombuffer(raw, dtype=torch.float32).view(rows, -1)

    def row_hash(self, rows: int, index: int) -> bytes:
        """Row ``index``'s signed SHA-256."""
        at = rows * DIGEST_BYTES + index * HASH_BYTES
        return self.digests[at : at + HASH_BYTES]


def row_hash(tensor: torch.Tensor) -> bytes:
    """The SHA-256 of a row's tensor as it crosses the wire: its dtype, shape and bytes."""
    tensor = tensor.contiguous()
    shape = struct.pack(f"<{tensor.dim()}I", *tensor.shape)
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.float32 else tensor
    return hashlib.sha256(str(tensor.dtype).encode() + shape + raw.numpy().tobytes()).digest()


def _row_slices(rows: Rows) -> list[slice]:
    """Each row's tokens in the frame's tensor."""
    starts = [0]
    for _, _, count in rows:
        starts.append(starts[-1] + count)
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def statement(seed: int, sender: str, rows: Rows, digests: bytes) -> bytes:
    """The bytes a frame's signature covers."""
    name = sender.encode()
    keys = b"".join(ROW_KEY.pack(*row) for row in rows)
    return DOMAIN + struct.pack("<QH", seed & (2**64 - 1), len(name)) + name + keys + digests


def sign(
    key: ec.EllipticCurvePrivateKey,
    seed: int,
    sender: str,
    rows: Rows,
    digests: torch.Tensor,
    tensor: torch.Tensor,
) -> Signed:
    """Sign ``digests`` ([rows, DIGEST_WIDTH]) of ``rows``, and the hashes of their bytes in
    ``tensor`` (as sent), as ``sender``."""
    raw = digests.contiguous().float().numpy().tobytes()
    raw += b"".join(row_hash(tensor[part]) for part in _row_slices(rows))
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


class Refusal(NamedTuple):
    """Why a receiver refuses a frame ("" when it takes it), and the row, if any, whose bytes
    hash as signed and digest otherwise: the sender's own signature shows it lied."""

    why: str
    shown_row: int | None = None


def frame_refusal(
    key: ec.EllipticCurvePublicKey | None,
    seed: int,
    sender: str,
    rows: Rows,
    tensor: torch.Tensor,
    signed: Signed | None,
) -> Refusal:
    """Whether a receiver refuses a HIDDEN frame of ``rows`` and ``tensor``: it does unless
    ``sender`` signed it and each row's bytes are what the signature says."""
    if key is None:
        return Refusal(f"no certificate of {sender}'s to check its signature with")
    if signed is None:
        return Refusal(f"{sender} sent it unsigned")
    if len(rows) > MAX_SIGNED_ROWS:
        return Refusal(f"{len(rows)} rows, more than the {MAX_SIGNED_ROWS} a statement reports")
    try:
        claimed = signed.digest_rows(len(rows))
    except ValueError as exc:
        return Refusal(f"its statement is malformed: {exc}")
    if not signed_by(key, seed, sender, rows, signed):
        return Refusal(f"its signature is not {sender}'s")
    for index, ((_, position, _), part) in enumerate(zip(rows, _row_slices(rows))):
        if row_hash(tensor[part]) != signed.row_hash(len(rows), index):
            return Refusal(
                f"the bytes it holds are not those {sender} signed (position {position})"
            )
        if _digest_apart(tensor[part], position, seed, claimed[index]):
            why = f"{sender} signed a digest its rows' bytes do not make (position {position})"
            return Refusal(why, index)
    return Refusal("")


def _digest_apart(row: torch.Tensor, position: int, seed: int, said: torch.Tensor) -> bool:
    got, row_scale = digest.digest(row, position, seed), digest.scale(row, position, seed)
    return digest.differs(got, said, row_scale, torch.float32) > 1


def proves_lie(
    keys: list[ec.EllipticCurvePublicKey],
    seed: int,
    sender: str,
    rows: Rows,
    signed: Signed,
    index: int,
    row: torch.Tensor,
) -> bool:
    """Whether ``row`` (the bytes of ``rows[index]``, shown by a receiver) with ``signed`` proves
    ``sender`` signed a digest other than its bytes make: one of its keys signed the statement,
    the bytes hash as signed, and their digest is another. An honest sender signs no such
    thing; a receiver cannot make one up."""
    if not 0 <= index < len(rows) or row.shape[:1] != (rows[index][2],):
        return False
    try:
        said = signed.digest_rows(len(rows))[index]
    except ValueError:
        return False
    if row_hash(row) != signed.row_hash(len(rows), index):
        return False
    if not any(signed_by(key, seed, sender, rows, signed) for key in keys):
        return False
    return _digest_apart(row, rows[index][1], seed, said)


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


def shown_row(proof: FrameProof, raw: bytes) -> torch.Tensor:
    """The row a proof shows (``raw``: its bytes), as its sender sent it; ValueError when the
    bytes do not fit it."""
    dtype = getattr(torch, proof.dtype)
    width = math.prod(proof.width) * torch.empty(0, dtype=dtype).element_size()
    if not width or not raw or len(raw) % width:
        raise ValueError(f"{len(raw)} bytes are no whole number of rows of {proof.width}")
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(-1, *proof.width)
