"""The wire format: a fixed 12-byte header, then a typed payload. No pickle anywhere.

Header (little-endian): magic ``b"SEAM"``, version u16, type u16, payload length u32.
Everything is validated — magic, version, type, a per-type length cap, row counts, dtype,
shape — before any payload buffer is allocated, so a garbage or oversized frame costs
nothing but the closed connection.

Payloads:
- CONTROL: UTF-8 JSON of one typed message (see ``seamline.net.messages``).
- HIDDEN: the residual stream for a batch of rows (one row = one sequence's tokens):
  u16 rows, u8 dtype, u8 ndim, u32 × ndim shape, rows × ROW, then the raw tensor bytes.
  ``shape[0]`` is the total token count; a row's ``count`` tokens are consecutive. With
  ``IDS_FLAG`` set in the dtype byte, the tokens' ids follow (i32 × tokens): a stage whose
  layers route by token id (DeepSeek-V4's hash-routed experts) needs them. With
  ``SIGNED_FLAG``, the sender's statement follows last (``mesh.protocol.frame_signing``): u8
  signature length, the signature, then rows × DIGEST_WIDTH f32 digests, then rows × 32-byte
  SHA-256s of the rows' bytes.
- TOKEN: sampled token ids travelling from the last stage back to stage 0:
  u16 rows, then rows × TOKEN_ROW, then for each row flagged ``LOGPROBS`` (in row order) its
  log-probability (f32), a count k (u8) and k × (token i32, log-probability f32), then for
  each row flagged ``DRAFTS`` a count k (u8) and k × token (i32): the last stage's
  multi-token-prediction drafts for the sequence's next window.
A ROW carries (request id, position, count, prefix hash before, prefix hash after, flags):
the receiver refuses a row whose position or prefix hash is out of step with its record.
Bits 16-23 of a HIDDEN row's flags (``drafts_wanted``) ask the last stage for that many drafts.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass, replace

import torch

MAGIC = b"SEAM"
VERSION = 1
HEADER = struct.Struct("<4sHHI")
ROW = struct.Struct("<QIIQQI")  # request, position, count, hash_before, hash_after, flags
TOKEN_ROW = struct.Struct("<QIIQQI")  # request, position, token, hash_before, hash_after, flags
LOGPROB = struct.Struct("<fB")  # a token's log-probability, how many alternatives follow
ALTERNATIVE = struct.Struct("<if")  # token id, log-probability
DRAFT_COUNT = struct.Struct("<B")
DRAFT = struct.Struct("<i")
WANTED_SHIFT, WANTED_MASK = (
    16,
    0xFF,
)  # a HIDDEN row's flags: drafts wanted from the last stage's MTP layer
MAX_ROWS = 4096
MAX_NDIM = 4


class FrameError(Exception):
    """A frame broke the wire format; the connection that sent it is closed (unless its
    payload was read whole and the receiver trusts its peer to stay in step)."""


class Desync(FrameError):
    """A header that is no seamline frame's: nothing after it on that stream can be trusted."""


class Oversized(FrameError):
    """A well-formed header over the cap: its ``length`` payload bytes have not been read."""

    def __init__(self, message: str, length: int) -> None:
        super().__init__(message)
        self.length = length


class FrameType(enum.IntEnum):
    CONTROL = 1
    HIDDEN = 2
    TOKEN = 3


class RowFlag(enum.IntFlag):
    NONE = 0
    FIRST = 1  # the row starts a new sequence at position 0
    SAMPLE = 2  # the last stage samples after this row (end of the prompt, or a decode step)
    DONE = 4  # (TOKEN) generation ended: stop token, max tokens or context full
    STOPPED = 8  # (TOKEN) ended on a stop token (which is not part of the output)
    LOGPROBS = 16  # (TOKEN) the row's log-probabilities follow the rows
    WINDOW = 32  # (HIDDEN) the tokens after the row's first are drafts: a draw after each while they are accepted
    FOLLOW = 64  # (HIDDEN, with WINDOW) the row's first token is a draft too: it goes on from the window before,
    # as if that one is accepted whole; the last stage draws only if its last draw was that first token
    DRAFTS = 128  # (TOKEN) the model's drafts for the sequence's next window follow the log-probabilities


LIMITS = {FrameType.CONTROL: 1 << 20, FrameType.HIDDEN: 256 << 20, FrameType.TOKEN: 1 << 20}
# Before a peer has proved who it is: a few small control messages, nothing else.
HANDSHAKE_LIMITS = {FrameType.CONTROL: 16 << 10, FrameType.HIDDEN: 0, FrameType.TOKEN: 0}
HANDSHAKE_DEADLINE_S = 10.0  # and a whole handshake message within this

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
IDS_FLAG = 0x80  # in the dtype byte: the tokens' ids follow the tensor
SIGNED_FLAG = 0x40  # in the dtype byte: the sender's signed statement follows
STATEMENT_ROW = 16 * 4 + 32  # a row in a statement: its DIGEST_WIDTH float32 digest, its SHA-256
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Row:
    request: int
    position: int
    count: int
    hash_before: int
    hash_after: int
    flags: int = 0


@dataclass(frozen=True)
class TokenRow:
    request: int
    position: int  # where the token goes in the sequence
    token: int
    hash_before: int
    hash_after: int
    flags: int = 0
    logprob: float | None = (
        None  # with LOGPROBS: the token's, and the likeliest tokens' (id, logprob)
    )
    top: tuple[tuple[int, float], ...] = ()
    drafts: tuple[int, ...] = ()  # with DRAFTS: the tokens the model drafts after this one


def drafts_wanted(flags: int) -> int:
    """How many drafts a HIDDEN row asks of the last stage's multi-token-prediction layer."""
    return (flags >> WANTED_SHIFT) & WANTED_MASK


def asking_drafts(flags: int, wanted: int) -> int:
    """``flags`` with ``wanted`` drafts asked (0 to 255)."""
    return (flags & ~(WANTED_MASK << WANTED_SHIFT)) | (
        min(max(wanted, 0), WANTED_MASK) << WANTED_SHIFT
    )


@dataclass(frozen=True)
class HiddenFrame:
    rows: tuple[Row, ...]
    tensor: torch.Tensor  # [tokens, ...]
    ids: torch.Tensor | None = None  # [tokens] int64, when the sender passes them
    signed: tuple[bytes, bytes] | None = None  # the sender's statement: (digests, signature)


@dataclass(frozen=True)
class TokenFrame:
    rows: tuple[TokenRow, ...]


def prefix_hash(previous: int, tokens: list[int], key: bytes | None = None) -> int:
    """Rolling 64-bit FNV-1a style hash of a token prefix. With ``key`` a keyed BLAKE2b chain
    instead: FNV steps can be undone, so from two hashes a peer would read the token between
    them; without the key it reads nothing (a private mesh's rows, ``--private``)."""
    value = previous
    if key is not None:
        for token in tokens:
            step = hashlib.blake2b(
                struct.pack("<Qq", value, token), key=key, digest_size=8
            ).digest()
            value = int.from_bytes(step, "little")
        return value
    for token in tokens:
        value = ((value ^ (token + 1)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


EMPTY_HASH = 0xCBF29CE484222325


def parse_header(data: bytes, limits: dict[FrameType, int] = LIMITS) -> tuple[FrameType, int]:
    """Validate a header against ``limits`` (per type, bytes); return (type, payload length)."""
    magic, version, kind, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise Desync(f"bad magic {magic!r}: not a seamline frame")
    if version != VERSION:
        raise Desync(f"protocol version {version} is not {VERSION}")
    try:
        frame_type = FrameType(kind)
    except ValueError:
        raise Desync(f"unknown frame type {kind}") from None
    if length > limits[frame_type]:
        raise Oversized(
            f"{frame_type.name} frame of {length} bytes exceeds the {limits[frame_type]} cap",
            length,
        )
    return frame_type, length


def header(frame_type: FrameType, length: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, int(frame_type), length)


def encode_hidden(
    rows: list[Row] | tuple[Row, ...],
    tensor: torch.Tensor,
    ids: torch.Tensor | None = None,
    signed: tuple[bytes, bytes] | None = None,
) -> list[bytes | memoryview]:
    """Buffers of one HIDDEN frame (header included), ready for ``socket.sendmsg``."""
    tensor = tensor.contiguous()
    if sum(r.count for r in rows) != tensor.shape[0]:
        raise FrameError(
            f"rows cover {sum(r.count for r in rows)} tokens, tensor has {tensor.shape[0]}"
        )
    if ids is not None and tuple(ids.shape) != (tensor.shape[0],):
        raise FrameError(f"{tuple(ids.shape)} ids for a tensor of {tensor.shape[0]} tokens")
    if signed is not None and (
        len(signed[0]) != len(rows) * STATEMENT_ROW or not 0 < len(signed[1]) < 256
    ):
        raise FrameError(f"a statement of {len(signed[0])} bytes of digests for {len(rows)} rows")
    code = (
        DTYPE_CODES[tensor.dtype]
        | (IDS_FLAG if ids is not None else 0)
        | (SIGNED_FLAG if signed is not None else 0)
    )
    meta = struct.pack(f"<HBB{tensor.dim()}I", len(rows), code, tensor.dim(), *tensor.shape)
    meta += b"".join(
        ROW.pack(r.request, r.position, r.count, r.hash_before, r.hash_after, r.flags) for r in rows
    )
    raw = (
        tensor.view(torch.uint8).reshape(-1)
        if tensor.dtype != torch.float32
        else tensor.reshape(-1)
    )
    body = raw.numpy().data.cast("B")
    tail = [] if ids is None else [ids.to(torch.int32).numpy().tobytes()]
    if signed is not None:
        tail.append(bytes([len(signed[1])]) + signed[1] + signed[0])
    size = len(meta) + body.nbytes + sum(len(t) for t in tail)
    return [header(FrameType.HIDDEN, size) + meta, body, *tail]


def decode_hidden(payload: bytes | bytearray | memoryview) -> HiddenFrame:
    view = memoryview(payload)
    if len(view) < 4:
        raise FrameError("HIDDEN frame too short for its row count")
    n_rows, code, ndim = struct.unpack_from("<HBB", view, 0)
    with_ids, with_statement = bool(code & IDS_FLAG), bool(code & SIGNED_FLAG)
    code &= ~(IDS_FLAG | SIGNED_FLAG)
    if n_rows == 0 or n_rows > MAX_ROWS:
        raise FrameError(f"HIDDEN frame has {n_rows} rows (1..{MAX_ROWS} allowed)")
    if code not in CODE_DTYPES:
        raise FrameError(f"HIDDEN frame has unknown dtype code {code}")
    if not 1 <= ndim <= MAX_NDIM:
        raise FrameError(f"HIDDEN frame has {ndim} dims (1..{MAX_NDIM} allowed)")
    offset = 4 + 4 * ndim
    rows_end = offset + n_rows * ROW.size
    if len(view) < rows_end:
        raise FrameError("HIDDEN frame too short for its shape and rows")
    shape = struct.unpack_from(f"<{ndim}I", view, 4)
    rows = tuple(Row(*ROW.unpack_from(view, offset + i * ROW.size)) for i in range(n_rows))
    dtype = CODE_DTYPES[code]
    expected = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
    id_bytes = 4 * shape[0] if with_ids else 0
    signed = None
    if with_statement:
        view, signed = _statement(view, rows_end + expected + id_bytes, n_rows)
    if len(view) - rows_end != expected + id_bytes:
        raise FrameError(
            f"HIDDEN frame carries {len(view) - rows_end} bytes after its rows, shape {shape} "
            f"{'and its ids ' if with_ids else ''}need {expected + id_bytes}"
        )
    if sum(r.count for r in rows) != shape[0]:
        raise FrameError(
            f"HIDDEN rows cover {sum(r.count for r in rows)} tokens, shape says {shape[0]}"
        )
    ids = None
    if with_ids:
        raw_ids = bytearray(view[rows_end + expected :])
        ids = (
            torch.frombuffer(raw_ids, dtype=torch.int32).long()
            if raw_ids
            else torch.empty(0, dtype=torch.long)
        )
    if not expected:
        return HiddenFrame(rows, torch.empty(shape, dtype=dtype), ids, signed)
    body = view[rows_end : rows_end + expected]
    body = body if not view.readonly else memoryview(bytearray(body))
    return HiddenFrame(rows, torch.frombuffer(body, dtype=dtype).view(shape), ids, signed)


def _statement(view: memoryview, at: int, rows: int) -> tuple[memoryview, tuple[bytes, bytes]]:
    """A HIDDEN payload's signed statement, from ``at`` on; (the payload before it, the
    statement)."""
    if len(view) <= at:
        raise FrameError("HIDDEN frame is flagged signed but carries no statement")
    length = view[at]
    end = at + 1 + length + rows * STATEMENT_ROW
    if length == 0 or len(view) != end:
        raise FrameError(f"HIDDEN frame's statement is {len(view) - at} bytes, not {end - at}")
    signature = bytes(view[at + 1 : at + 1 + length])
    return view[:at], (bytes(view[at + 1 + length : end]), signature)


def encode_tokens(rows: list[TokenRow] | tuple[TokenRow, ...]) -> bytes:
    body = struct.pack("<H", len(rows)) + b"".join(
        TOKEN_ROW.pack(r.request, r.position, r.token, r.hash_before, r.hash_after, r.flags)
        for r in rows
    )
    for r in rows:
        if r.flags & RowFlag.LOGPROBS:
            body += LOGPROB.pack(r.logprob or 0.0, len(r.top)) + b"".join(
                ALTERNATIVE.pack(i, lp) for i, lp in r.top
            )
    for r in rows:
        if r.flags & RowFlag.DRAFTS:
            body += DRAFT_COUNT.pack(len(r.drafts)) + b"".join(DRAFT.pack(t) for t in r.drafts)
    return header(FrameType.TOKEN, len(body)) + body


def decode_tokens(payload: bytes | bytearray | memoryview) -> TokenFrame:
    view = memoryview(payload)
    if len(view) < 2:
        raise FrameError("TOKEN frame too short for its row count")
    (n_rows,) = struct.unpack_from("<H", view, 0)
    end = 2 + n_rows * TOKEN_ROW.size
    if n_rows == 0 or len(view) < end:
        raise FrameError(f"TOKEN frame of {len(view)} bytes does not hold {n_rows} rows")
    rows = []
    for i in range(n_rows):
        row = TokenRow(*TOKEN_ROW.unpack_from(view, 2 + i * TOKEN_ROW.size))
        if row.flags & RowFlag.LOGPROBS:
            row, end = _with_logprobs(view, end, row)
        rows.append(row)
    for i, row in enumerate(rows):
        if row.flags & RowFlag.DRAFTS:
            rows[i], end = _with_drafts(view, end, row)
    if end != len(view):
        raise FrameError(
            f"TOKEN frame of {len(view)} bytes: its rows and log-probabilities take {end}"
        )
    return TokenFrame(tuple(rows))


def _with_logprobs(view: memoryview, at: int, row: TokenRow) -> tuple[TokenRow, int]:
    if len(view) < at + LOGPROB.size:
        raise FrameError("TOKEN frame too short for a row's log-probability")
    logprob, count = LOGPROB.unpack_from(view, at)
    at += LOGPROB.size
    if len(view) < at + count * ALTERNATIVE.size:
        raise FrameError(f"TOKEN frame too short for {count} alternatives")
    top = tuple(ALTERNATIVE.unpack_from(view, at + j * ALTERNATIVE.size) for j in range(count))
    return replace(row, logprob=logprob, top=top), at + count * ALTERNATIVE.size


def _with_drafts(view: memoryview, at: int, row: TokenRow) -> tuple[TokenRow, int]:
    if len(view) < at + DRAFT_COUNT.size:
        raise FrameError("TOKEN frame too short for a row's draft count")
    (count,) = DRAFT_COUNT.unpack_from(view, at)
    at += DRAFT_COUNT.size
    if len(view) < at + count * DRAFT.size:
        raise FrameError(f"TOKEN frame too short for {count} drafts")
    drafts = tuple(DRAFT.unpack_from(view, at + j * DRAFT.size)[0] for j in range(count))
    return replace(row, drafts=drafts), at + count * DRAFT.size


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
