"""Signed frames (``mesh.protocol.frame_signing``) and who is blamed when two stages disagree
on what crossed between them (``mesh.control.link_blame``): a receiver cannot be framed, and a
sender cannot deny what it signed."""

from __future__ import annotations

import torch

from seamline.mesh.control.frame_proofs import ProofParts, judge
from seamline.mesh.control.joining import MEMBER_LIMITS
from seamline.mesh.control.link_blame import Crossing, liars
from seamline.mesh.identity import new_key
from seamline.mesh.node.checks import digest_reporter, frame_proof
from seamline.mesh.protocol import frame_signing
from seamline.net.frames import FrameError, FrameType, Row, decode_hidden, encode_hidden
from seamline.net.messages import (
    FrameProof,
    FrameProofPart,
    Message,
    decode_message,
    encode_message,
)
from seamline.runtime import digest

SEED = 12345
ROWS = [(7, 0, 3), (9, 5, 1)]


def _frame() -> tuple[torch.Tensor, torch.Tensor]:
    """Four tokens of hidden state, and each row's digest."""
    tensor = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    digests = torch.stack(
        [digest.digest(tensor[0:3], 0, SEED), digest.digest(tensor[3:4], 5, SEED)]
    )
    return tensor, digests


def test_a_signed_frame_crosses_the_wire_and_checks_out() -> None:
    key = new_key()
    tensor, digests = _frame()
    signed = frame_signing.sign(key, SEED, "node_a", ROWS, digests, tensor)
    rows = [Row(r, p, c, 0, 0) for r, p, c in ROWS]
    payload = b"".join(bytes(b) for b in encode_hidden(rows, tensor, None, signed))[12:]
    frame = decode_hidden(payload)
    assert frame.signed == tuple(signed) and torch.equal(frame.tensor, tensor)
    got = frame_signing.Signed(*frame.signed)
    public = key.public_key()
    assert frame_signing.frame_refusal(public, SEED, "node_a", ROWS, frame.tensor, got).why == ""
    # the same bytes under another name, seed or key are refused
    refusal = frame_signing.frame_refusal(public, SEED, "node_b", ROWS, tensor, got)
    assert "not node_b's" in refusal.why and refusal.shown_row is None
    assert frame_signing.frame_refusal(public, SEED + 1, "node_a", ROWS, tensor, got).why
    other = new_key().public_key()
    assert frame_signing.frame_refusal(other, SEED, "node_a", ROWS, tensor, got).why
    refusal = frame_signing.frame_refusal(public, SEED, "node_a", ROWS, tensor, None)
    assert "unsigned" in refusal.why


def test_a_frame_whose_rows_are_not_what_was_signed_is_refused() -> None:
    key = new_key()
    tensor, digests = _frame()
    signed = frame_signing.sign(key, SEED, "node_a", ROWS, digests, tensor)
    altered = tensor.clone()
    altered[3] *= 1.05
    refusal = frame_signing.frame_refusal(key.public_key(), SEED, "node_a", ROWS, altered, signed)
    assert refusal.why == "the bytes it holds are not those node_a signed (position 5)"
    assert refusal.shown_row is None  # the receiver could have made these bytes up
    # one bit of one byte is enough
    flipped = tensor.clone()
    flipped.view(torch.int32)[0, 0] ^= 1
    refusal = frame_signing.frame_refusal(key.public_key(), SEED, "node_a", ROWS, flipped, signed)
    assert "(position 0)" in refusal.why


def test_a_truncated_statement_is_a_frame_error() -> None:
    tensor, digests = _frame()
    signed = frame_signing.sign(new_key(), SEED, "node_a", ROWS, digests, tensor)
    rows = [Row(r, p, c, 0, 0) for r, p, c in ROWS]
    payload = b"".join(bytes(b) for b in encode_hidden(rows, tensor, None, signed))[12:]
    for cut in (1, 10, 100):
        try:
            decode_hidden(payload[:-cut])
        except FrameError:
            continue
        raise AssertionError(f"a statement cut by {cut} bytes was taken")


def _crossing(reported: torch.Tensor, expected: torch.Tensor, row: tuple = ROWS[0]) -> Crossing:
    return Crossing(row, reported, expected, float(expected.norm()), torch.float32)


def test_blame_falls_on_the_one_whose_signature_or_report_shows_the_lie() -> None:
    key = new_key()
    tensor, honest = _frame()
    public = key.public_key()
    perturbed = torch.stack([honest[0] * 1.05, honest[1]])
    # the sender signed and sent other rows than its layers make: the sender
    statement = (ROWS, frame_signing.sign(key, SEED, "node_a", ROWS, perturbed, tensor))
    who, why = liars(_crossing(perturbed[0], honest[0]), "node_a", [public], SEED, statement)
    assert who == ("sender",) and "signed and sent" in why
    # an honest statement, and a receiver that says it took something else: the receiver
    statement = (ROWS, frame_signing.sign(key, SEED, "node_a", ROWS, honest, tensor))
    who, _ = liars(_crossing(perturbed[0], honest[0]), "node_a", [public], SEED, statement)
    assert who == ("receiver",)
    # a statement the sender never signed (forged by the receiver): the receiver
    forged = (ROWS, frame_signing.sign(new_key(), SEED, "node_a", ROWS, perturbed, tensor))
    who, _ = liars(_crossing(perturbed[0], honest[0]), "node_a", [public], SEED, forged)
    assert who == ("receiver",)
    # no statement at all: the receiver computed on an unsigned frame
    who, _ = liars(_crossing(perturbed[0], honest[0]), "node_a", [public], SEED, None)
    assert who == ("receiver",)
    # a statement for other rows than the one in question: the receiver
    who, _ = liars(
        _crossing(perturbed[0], honest[0], (8, 0, 3)), "node_a", [public], SEED, statement
    )
    assert who == ("receiver",)
    # nothing signed (a plaintext mesh): both, as before
    who, _ = liars(_crossing(perturbed[0], honest[0]), "node_a", [], SEED, None)
    assert who == ("sender", "receiver")


def _shown(
    signed: frame_signing.Signed, tensor: torch.Tensor, index: int
) -> tuple[FrameProof, bytes]:
    """A receiver's proof, row ``index`` of ``tensor`` with the statement ``signed``, as the
    coordinator puts it together from its messages over the wire."""
    rows = [Row(r, p, c, 0, 0) for r, p, c in ROWS]
    frame = decode_hidden(
        b"".join(bytes(b) for b in encode_hidden(rows, tensor, None, signed))[12:]
    )
    messages = [
        decode_message(encode_message(m)[12:]) for m in frame_proof(3, "node_a", frame, index)
    ]
    parts = ProofParts()
    assert parts.begin("node_b", messages[0]) == ""
    for part in messages[1:-1]:
        assert parts.add("node_b", part) == (None, b"", "")
    proof, raw, refused = parts.add("node_b", messages[-1])
    assert proof is not None and not refused
    return proof, raw


def test_a_sender_that_signs_honest_digests_for_altered_bytes_is_shown_by_its_own_signature() -> (
    None
):
    key = new_key()
    tensor, honest = _frame()
    altered = tensor.clone()
    altered[3] *= 1.05
    signed = frame_signing.sign(key, SEED, "node_a", ROWS, honest, altered)
    refusal = frame_signing.frame_refusal(key.public_key(), SEED, "node_a", ROWS, altered, signed)
    assert "node_a signed a digest its rows' bytes do not make (position 5)" == refusal.why
    assert refusal.shown_row == 1
    proof, raw = _shown(signed, altered, 1)
    keys = [new_key().public_key(), key.public_key()]
    lied, why = judge(proof, raw, keys, SEED)
    assert lied and "positions [5, 6)" in why
    # the row that matches what was signed proves nothing; nor does another key, seed or sender
    assert not judge(*_shown(signed, altered, 0), keys, SEED)[0]
    assert not judge(proof, raw, [new_key().public_key()], SEED)[0]
    assert not judge(proof, raw, [], SEED)[0]
    assert not judge(proof, raw, keys, SEED + 1)[0]
    assert not judge(proof.model_copy(update={"sender": "node_b"}), raw, keys, SEED)[0]


def test_a_receiver_cannot_show_a_lie_an_honest_sender_never_signed() -> None:
    key = new_key()
    tensor, honest = _frame()
    signed = frame_signing.sign(key, SEED, "node_a", ROWS, honest, tensor)
    keys = [key.public_key()]
    proof, raw = _shown(signed, tensor, 1)
    assert not judge(proof, raw, keys, SEED)[0]  # the honest row: nothing to show
    # other bytes than those signed: they do not hash as signed
    altered = tensor.clone()
    altered[3] *= 1.05
    lied, why = judge(proof, _shown(signed, altered, 1)[1], keys, SEED)
    assert not lied and "does not contradict" in why
    # bytes that are no whole row, or a row index past the statement
    assert not judge(proof, raw[:8], keys, SEED)[0]
    assert not judge(proof.model_copy(update={"row": 7}), raw, keys, SEED)[0]


def test_a_proof_is_put_together_in_turn_and_no_larger_than_its_row() -> None:
    key = new_key()
    tensor = torch.randn(40, 600, generator=torch.Generator().manual_seed(2))  # 96 KB: 4 parts
    rows = [(7, 0, 40)]
    digests = digest.digest(tensor, 0, SEED)[None]
    signed = frame_signing.sign(key, SEED, "node_a", rows, digests, tensor)
    frame = decode_hidden(
        b"".join(bytes(b) for b in encode_hidden([Row(7, 0, 40, 0, 0)], tensor, None, signed))[12:]
    )
    head, *parts = frame_proof(3, "node_a", frame, 0)
    assert len(parts) == 4 and all(len(encode_message(m)) < 64 << 10 for m in (head, *parts))
    gathering = ProofParts()
    assert gathering.begin("node_b", head) == ""
    out_of_turn = gathering.add("node_b", parts[1])[2]
    assert (
        out_of_turn
        == f"a proof part refused: a part from byte {parts[1].offset}, where 0 came so far"
    )
    assert gathering.add("node_b", parts[0])[2] == "a proof part with no proof begun"  # dropped
    gathering.begin("node_b", head)
    for part in parts[:-1]:
        gathering.add("node_b", part)
    too_long = FrameProofPart(offset=parts[3].offset, data=parts[0].data)
    assert gathering.add("node_b", too_long)[2].endswith(f"where {40 * 600 * 4} are expected")
    huge = head.model_copy(update={"width": [1 << 20]})
    assert "row" in gathering.begin("node_b", huge)


def test_the_report_of_the_largest_signed_frame_fits_a_members_control_link() -> None:
    rows = [(2**62 + i, 2**20, 1) for i in range(frame_signing.MAX_SIGNED_ROWS)]
    tensor = torch.randn(len(rows), 8)
    signed = frame_signing.sign(new_key(), SEED, "node_a", rows, torch.zeros(len(rows), 16), tensor)
    sent: list[Message] = []
    digest_reporter(3, sent.append, (0, 15))(rows, torch.zeros(len(rows), 2, 16), (rows, signed))
    assert [len(m.rows) for m in sent] == [32, 128, 96] and sent[0].receipt is not None
    cap = MEMBER_LIMITS[FrameType.CONTROL]
    assert all(len(encode_message(m)) <= cap for m in sent), [len(encode_message(m)) for m in sent]
    # a frame of more rows is refused before anything is computed from it
    more = [*rows, (1, 0, 1)]
    key = new_key()
    signed = frame_signing.sign(
        key, SEED, "node_a", more, torch.zeros(len(more), 16), torch.randn(len(more), 8)
    )
    refusal = frame_signing.frame_refusal(
        key.public_key(), SEED, "node_a", more, torch.randn(len(more), 8), signed
    )
    assert "257 rows, more than the 256" in refusal.why
