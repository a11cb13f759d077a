"""Bytes too large for one message of a member's control link (``joining.MEMBER_LIMITS``, 64
KiB), sent in parts: a chosen stage's kept rows (``KeptRows``), a refused frame's row
(``FrameProofPart``). Each part says where its bytes begin; the receiver takes them in order and
no more than it expects."""

from __future__ import annotations

import base64

PART_BYTES = 30 << 10  # bytes a part carries: 40 KiB in base64, with room for its message
PART_CHARS = PART_BYTES * 4 // 3 + 4  # a part's base64 text at most


def split(raw: bytes, size: int = PART_BYTES) -> list[tuple[int, str]]:
    """``raw`` as (offset, base64 text) parts of at most ``size`` bytes each, in order."""
    return [(at, base64.b64encode(raw[at : at + size]).decode()) for at in range(0, len(raw), size)]


def gather(arriving: bytearray, offset: int, data: str, size: int) -> bytes | None:
    """Add the part at ``offset`` to ``arriving`` (the parts so far): the whole ``size`` bytes
    once they all came (``arriving`` emptied), None before; ValueError for a part out of turn,
    not base64, or past ``size``."""
    if offset != len(arriving):
        raise ValueError(f"a part from byte {offset}, where {len(arriving)} came so far")
    arriving += base64.b64decode(data, validate=True)
    if len(arriving) > size:
        raise ValueError(f"{len(arriving)} bytes where {size} are expected")
    if len(arriving) < size:
        return None
    whole = bytes(arriving)
    arriving.clear()
    return whole
