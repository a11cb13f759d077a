"""Who lied when two stages disagree on what crossed between them (``verify``).

The receiver reports the digest of what it took; the coordinator's own run says what the
sender's layers make of the row. Every frame a stage computes on carries its sender's
signature over the digests of its rows (``mesh.protocol.frame_signing``), and the receiver
reports that statement with its digests. So:

- no statement, or one its sender's key did not sign: the receiver computed on a frame it
  cannot show was sent to it (an honest one refuses such a frame): the receiver lied;
- a signed digest that is not what the sender's layers make: the sender sent something else
  than its layers compute, and signed it: the sender lied;
- a signed digest that is right, and a receiver that reports having taken something else: the
  receiver lied.

Without certificates (a plaintext mesh) nothing is signed, and both are at fault, as neither
can be told from the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.asymmetric import ec

from seamline.mesh.protocol.frame_signing import Signed, signed_by
from seamline.runtime import digest

RowKey = tuple[int, int, int]  # request, position, count
Statement = tuple[list[RowKey], Signed]  # a frame's rows and its sender's statement


@dataclass(frozen=True)
class Crossing:
    """One row as it crossed from the sender's stage to the receiver's."""

    row: RowKey
    reported: torch.Tensor  # the receiver's digest of what it took
    expected: torch.Tensor  # the digest of what the sender's layers make of the row
    scale: float  # ``expected``'s scale (``digest.scale``)
    dtype: torch.dtype  # the receiver's compute dtype: the tolerance
    rows_alone: bool = False  # the mesh computes rows as alone: ``digest.ALONE_TOLERANCE``


def liars(
    crossing: Crossing,
    sender: str,
    keys: list[ec.EllipticCurvePublicKey],
    seed: int,
    statement: Statement | None,
) -> tuple[tuple[str, ...], str]:
    """Which of ("sender", "receiver") lied about ``crossing``, and why; () when the signed
    statement shows they agree after all (a digest at the edge of its tolerance). ``keys``:
    the sender's certificate keys (none: a plaintext mesh)."""
    if not keys:
        return ("sender", "receiver"), "nothing is signed here to tell which one"
    if statement is None:
        return ("receiver",), f"it computed on a frame it shows no signature of {sender}'s for"
    rows, signed = statement
    if crossing.row not in rows or not any(signed_by(k, seed, sender, rows, signed) for k in keys):
        return ("receiver",), f"it shows a statement {sender} did not sign for that row"
    said = signed.digest_rows(len(rows))[rows.index(crossing.row)]
    if _apart(said, crossing.expected, crossing):
        return ("sender",), "it signed and sent a frame other than what its layers compute"
    if _apart(crossing.reported, said, crossing):
        return ("receiver",), f"it reports having taken other than what {sender} signed"
    return (), ""


def _apart(got: torch.Tensor, expected: torch.Tensor, crossing: Crossing) -> bool:
    """Two digests of ``crossing``'s row further apart than rounding."""
    return digest.differs(got, expected, crossing.scale, crossing.dtype, crossing.rows_alone) > 1
