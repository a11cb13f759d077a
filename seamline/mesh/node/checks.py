"""A node's side of the coordinator's checks (``mesh.control.verify``): answering a start-up
probe with the digest of what its stage computes, and reporting the digests of every row it
runs when the plan asks (``Assign.digest_seed``)."""

from __future__ import annotations

import base64
from collections.abc import Callable

import torch

from seamline.net import messages
from seamline.net.byte_parts import split
from seamline.net.frames import HiddenFrame
from seamline.net.messages import MAX_DIGEST_ROWS, Digests, Message, Probe, ProbeResult
from seamline.runtime import digest
from seamline.runtime.stage_worker import Receipt, RowKeys, StageWorker

RECEIPT_PART_ROWS = 32  # rows of the Digests message that carries a statement


def probe_result(worker: StageWorker, probe: Probe) -> ProbeResult:
    """Run the probe's rows through this node's stage on a fresh cache; their digest."""
    stage = worker.stage
    ids = torch.tensor(probe.ids, dtype=torch.long)
    hidden = None
    if probe.hidden:
        raw = bytearray(base64.b64decode(probe.hidden.encode(), validate=True))
        shape = (len(probe.ids), *stage.boundary_shape)
        width = torch.empty(0, dtype=stage.compute_dtype).element_size()
        if len(raw) != width * len(probe.ids) * _numel(shape[1:]):
            return ProbeResult(
                probe=probe.probe,
                digest="",
                error=f"a probe of {len(raw)} bytes does not fit {shape}",
            )
        hidden = torch.frombuffer(raw, dtype=stage.compute_dtype).view(shape)
    with worker.lock:
        output, start = digest.probe_output(stage, ids, hidden)
    return ProbeResult(
        probe=probe.probe,
        digest=digest.pack(digest.digest(output, start, probe.seed).view(1, 1, -1)),
    )


def digest_reporter(
    plan_id: int, send: Callable[[Message], None], layers: tuple[int, int]
) -> Callable[[RowKeys, torch.Tensor, Receipt | None], None]:
    """What the stage of ``layers`` calls with each step's rows, digests and the statement of
    the frame they came in: Digests messages, a bounded number of rows each (the first carries
    the statement)."""

    def report(rows: RowKeys, digests: torch.Tensor, receipt: Receipt | None) -> None:
        if not rows:
            return
        # the statement's part carries fewer rows: with a statement of MAX_SIGNED_ROWS it fits
        # a member's control link (``joining.MEMBER_LIMITS``)
        first = RECEIPT_PART_ROWS if receipt is not None else MAX_DIGEST_ROWS
        starts = [0, *range(first, len(rows), MAX_DIGEST_ROWS)]
        for at, end in zip(starts, [*starts[1:], len(rows)]):
            send(
                Digests(
                    plan_id=plan_id,
                    layers=layers,
                    rows=rows[at:end],
                    digests=digest.pack(digests[at:end]),
                    receipt=_receipt(receipt) if receipt is not None and at == 0 else None,
                )
            )

    return report


def frame_proof(
    plan_id: int, sender: str, frame: HiddenFrame, index: int
) -> list[messages.Message]:
    """The proof that ``sender`` signed a digest other than row ``index`` of ``frame`` makes
    (``frame_signing.proves_lie``): a FrameProof and the parts of the row's bytes; none when the
    row is larger than a proof shows."""
    assert frame.signed is not None, "only a signed frame shows its sender's lie"
    rows = [(r.request, r.position, r.count) for r in frame.rows]
    start = sum(count for _, _, count in rows[:index])
    row = frame.tensor[start : start + rows[index][2]].contiguous()
    raw = (row.view(torch.uint8) if row.dtype != torch.float32 else row).numpy().tobytes()
    if not raw or len(raw) > messages.MAX_PROOF_BYTES:
        return []
    parts = [messages.FrameProofPart(offset=at, data=data) for at, data in split(raw)]
    proof = messages.FrameProof(
        plan_id=plan_id,
        sender=sender,
        receipt=_receipt((rows, frame.signed)),
        row=index,
        dtype=str(row.dtype).removeprefix("torch."),
        width=list(row.shape[1:]),
    )
    return [proof, *parts]


def _receipt(receipt: Receipt) -> messages.Receipt:
    rows, (digests, signature) = receipt
    return messages.Receipt(
        rows=rows,
        digests=base64.b64encode(digests).decode(),
        signature=base64.b64encode(signature).decode(),
    )


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
