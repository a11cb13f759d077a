"""A receiver's proof that its sender signed a digest other than a row's bytes make
(``frame_signing.proves_lie``): the coordinator checks it itself, so the sender is removed on
its own signature, never on the receiver's word.

A proof is a FrameProof (the frame's statement and which row) and the row's bytes in
FrameProofPart messages (``net.byte_parts``), each small enough for a member's control link. A member has at most
one proof being put together, no larger than the row its statement names."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from seamline.mesh.control.verify import Verifier
from seamline.mesh.protocol.frame_signing import from_receipt, proves_lie, shown_row
from seamline.net.byte_parts import gather
from seamline.net.messages import MAX_PROOF_BYTES, FrameProof, FrameProofPart

log = logging.getLogger("seamline.coordinator")


@dataclass
class _Gathering:
    proof: FrameProof
    size: int  # the bytes of the row the proof names
    arriving: bytearray = field(default_factory=bytearray)


class ProofParts:
    """Each member's proof as its parts arrive."""

    def __init__(self) -> None:
        self._gathering: dict[str, _Gathering] = {}
        self._lock = threading.Lock()

    def begin(self, node_id: str, proof: FrameProof) -> str:
        """A member's new proof (one it was putting together is dropped); why it is refused
        ("" when taken)."""
        with self._lock:
            self._gathering.pop(node_id, None)
        try:
            size = _row_bytes(proof)
        except ValueError as exc:
            return f"a malformed proof: {exc}"
        if not 0 < size <= MAX_PROOF_BYTES:
            return f"a proof of a {size}-byte row"
        with self._lock:
            self._gathering[node_id] = _Gathering(proof, size)
        return ""

    def add(self, node_id: str, part: FrameProofPart) -> tuple[FrameProof | None, bytes, str]:
        """A member's next part: (its proof and the row's bytes, once whole; why the part is
        refused, "" when taken)."""
        with self._lock:
            gathering = self._gathering.get(node_id)
            if gathering is None:
                return None, b"", "a proof part with no proof begun"
            try:
                raw = gather(gathering.arriving, part.offset, part.data, gathering.size)
            except ValueError as exc:
                del self._gathering[node_id]
                return None, b"", f"a proof part refused: {exc}"
            if raw is None:
                return None, b"", ""
            del self._gathering[node_id]
            return gathering.proof, raw, ""


def _row_bytes(proof: FrameProof) -> int:
    rows = proof.receipt.rows
    if proof.row >= len(rows):
        raise ValueError(f"row {proof.row} of a statement of {len(rows)}")
    element = torch.empty(0, dtype=getattr(torch, proof.dtype)).element_size()
    return rows[proof.row][2] * math.prod(proof.width) * element


def judge(proof: FrameProof, raw: bytes, keys: list[Any], seed: int) -> tuple[bool, str]:
    """Whether ``proof`` and the row's bytes ``raw`` show its sender lied (under the plan's
    digest ``seed``, against the sender's certificate ``keys``), and why or why not."""
    if not keys:
        return False, f"no certificate of {proof.sender}'s is on record to check it with"
    try:
        rows, signed = from_receipt(proof.receipt)
        row = shown_row(proof, raw)
    except ValueError as exc:
        return False, f"a malformed proof: {exc}"
    if not proves_lie(keys, seed, proof.sender, rows, signed, proof.row, row):
        return False, f"the row it shows does not contradict {proof.sender}'s statement"
    position = rows[proof.row][1]
    return True, (
        f"it signed a digest other than the bytes it sent make (positions [{position}, "
        f"{position + rows[proof.row][2]})), shown with its own signature"
    )


class ProofDesk:
    """Members' proofs as the coordinator takes them: put together, judged, and the liar removed
    (``expel``); a proof that does not hold is a refusal of its member's (``refuse``)."""

    def __init__(
        self,
        verifier: Verifier,
        keys_of: Callable[[str], list[Any]],
        refuse: Callable[[str, str], None],
        expel: Callable[[list[str], str], None],
    ) -> None:
        self.verifier, self.keys_of, self.refuse, self.expel = verifier, keys_of, refuse, expel
        self.parts = ProofParts()

    def take(self, node_id: str, message: FrameProof | FrameProofPart) -> None:
        if isinstance(message, FrameProof):
            refused = self.parts.begin(node_id, message)
            proof, raw = None, b""
        else:
            proof, raw, refused = self.parts.add(node_id, message)
        if refused:
            self.refuse(node_id, refused)
        if proof is None or proof.sender in self.verifier.expelled:
            return
        lied, why = judge(proof, raw, self.keys_of(proof.sender), self.verifier.seed)
        if not lied:
            self.refuse(node_id, f"frame proof against {proof.sender}: {why}")
            return
        log.error("verification: %s: %s (shown by %s)", proof.sender, why, node_id)
        # not on the showing member's reader: a removal waits for every member's confirmation,
        # this one's too, which that reader brings in
        threading.Thread(target=self.expel, args=([proof.sender], why), daemon=True).start()
