"""The control messages of the coordinator's checks of its members (``mesh.control.verify``):
start-up probes, each row's digests, and a receiver's proof that its sender lied."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from seamline.net.byte_parts import PART_CHARS
from seamline.net.message_base import Message, NodeName, Reason


class Probe(Message):
    """Coordinator -> a loaded stage, before its route is published: run these rows at positions
    0.. on a fresh cache and answer their digest (``runtime.digest``, under ``seed``). ``hidden``:
    the boundary tensor's bytes in the stage's dtype, base64 (empty for a stage that embeds)."""

    kind: Literal["probe"] = "probe"
    plan_id: int
    probe: int
    seed: int
    layers: tuple[int, int] | None = None  # which of the node's stages (a private mesh's holds two)
    ids: list[int] = Field(max_length=64)
    hidden: str = ""


class ProbeResult(Message):
    kind: Literal["probe_result"] = "probe_result"
    probe: int
    digest: str = Field(max_length=4096)  # ``digest.pack`` of [1, 1, DIGEST_WIDTH]
    error: Reason = ""


MAX_DIGEST_ROWS = 128  # rows a Digests message carries: well within a member's control cap


class Digests(Message):
    """A stage's digests of the rows of one step (``Assign.digest_seed``): for each row
    (request, position, count), what came in and what it computed (``digest.pack`` of
    [rows, 2, DIGEST_WIDTH]; zeros for stage 0's input, which is token ids)."""

    kind: Literal["digests"] = "digests"
    plan_id: int
    layers: tuple[int, int] = (0, 0)  # the stage that computed them (a private mesh's node has two)
    rows: list[tuple[int, int, int]] = Field(max_length=MAX_DIGEST_ROWS)
    digests: str = Field(max_length=MAX_DIGEST_ROWS * 2 * 16 * 4 * 4 // 3 + 8)
    receipt: Receipt | None = None  # the signed statement of the frame the rows came in


class Receipt(BaseModel):
    """A frame's rows and its sender's signed statement (``mesh.protocol.frame_signing``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rows: list[tuple[int, int, int]] = Field(max_length=4096)  # frames.MAX_ROWS
    digests: str = Field(max_length=4096 * (16 * 4 + 32) * 4 // 3 + 8)  # digests, then hashes
    signature: str = Field(max_length=128)


MAX_PROOF_BYTES = 32 << 20  # the largest row a proof shows


class FrameProof(Message):
    """A receiver shows the coordinator one row of a frame it refused, with the frame's signed
    statement: the row's bytes (in the FrameProofPart messages that follow) hash as the sender
    signed, and digest otherwise (``frame_signing.proves_lie``)."""

    kind: Literal["frame_proof"] = "frame_proof"
    plan_id: int
    sender: NodeName
    receipt: Receipt
    row: int = Field(ge=0, lt=4096)  # the row's index in ``receipt.rows``
    dtype: Literal["float32", "bfloat16", "float16"]
    width: list[int] = Field(max_length=4)  # the row's shape after its token count


class FrameProofPart(Message):
    """A part of the row a FrameProof shows: its bytes from ``offset`` (``net.byte_parts``)."""

    kind: Literal["frame_proof_part"] = "frame_proof_part"
    offset: int = Field(ge=0)
    data: str = Field(max_length=PART_CHARS)  # base64


class KeptRowsAsk(Message):
    """Coordinator -> a checked stage's leader, after the stage reported the digests of these
    rows: the input rows it computed on for ``request``'s positions [start, end)
    (``verify``; a stage of a checked mesh keeps them while it keeps the request's cache)."""

    kind: Literal["kept_rows_ask"] = "kept_rows_ask"
    plan_id: int
    layers: tuple[int, int]
    request: int
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class KeptRows(Message):
    """A part of a stage's kept input rows for positions [start, start + count): their bytes in
    the stage's compute dtype from ``offset``, base64 (``net.byte_parts``: the answer to one ask
    comes in parts, in order; ``gone``: the stage holds no such rows)."""

    kind: Literal["kept_rows"] = "kept_rows"
    plan_id: int
    layers: tuple[int, int]
    request: int
    start: int = Field(ge=0)
    count: int = Field(ge=0)
    offset: int = Field(default=0, ge=0)
    data: str = Field(max_length=PART_CHARS)
    gone: bool = False
