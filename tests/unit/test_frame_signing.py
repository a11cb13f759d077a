"""Signed frames (``mesh.protocol.frame_signing``) and who is blamed when two stages disagree
on what crossed between them (``mesh.control.link_blame``): a receiver cannot be framed, and a
sender cannot deny what it signed."""

from __future__ import annotations

import torch

from seamline.mesh.control.link_blame import Crossing, liars
from seamline.mesh.identity import new_key
from seamline.mesh.protocol import frame_signing
from seamline.net.frames import FrameError, Row, decode_hidden, encode_hidden
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
    signed = frame_signing.sign(key, SEED, "node_a", ROWS, digests)
    rows = [Row(r, p, c, 0, 0) for r, p, c in ROWS]
    payload = b"".join(bytes(b) for b in encode_hidden(rows, tensor, None, signed))[12:]
    frame = decode_hidden(payload)
    assert frame.signed == tuple(signed) and torch.equal(frame.tensor, tensor)
    got = frame_signing.Signed(*frame.signed)
    public = key.public_key()
    assert frame_signing.frame_refusal(public, SEED, "node_a", ROWS, frame.tensor, got) == ""
    # the same bytes under another name, seed or key are refused
    assert "not node_b's" in frame_signing.frame_refusal(public, SEED, "node_b", ROWS, tensor, got)
    assert frame_signing.frame_refusal(public, SEED + 1, "node_a", ROWS, tensor, got)
    other = new_key().public_key()
    assert frame_signing.frame_refusal(other, SEED, "node_a", ROWS, tensor, got)
    assert "unsigned" in frame_signing.frame_refusal(public, SEED, "node_a", ROWS, tensor, None)


def test_a_frame_whose_rows_are_not_what_was_signed_is_refused() -> None:
    key = new_key()
    tensor, digests = _frame()
    signed = frame_signing.sign(key, SEED, "node_a", ROWS, digests)
    altered = tensor.clone()
    altered[3] *= 1.05
    refusal = frame_signing.frame_refusal(key.public_key(), SEED, "node_a", ROWS, altered, signed)
    assert "not what node_a signed (position 5)" in refusal


def test_a_truncated_statement_is_a_frame_error() -> None:
    tensor, digests = _frame()
    signed = frame_signing.sign(new_key(), SEED, "node_a", ROWS, digests)
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
    statement = (ROWS, frame_signing.sign(key, SEED, "node_a", ROWS, perturbed))
    who, why = liars(_crossing(perturbed[0], honest[0]), "node_a", [public], SEED, statement)
    assert who == ("sender",) and "signed and sent" in why
    # an honest statement, and a receiver that says it took something else: the receiver
    statement = (ROWS, frame_signing.sign(key, SEED, "node_a", ROWS, honest))
    who, _ = liars(_crossing(perturbed[0], honest[0]), "node_a", [public], SEED, statement)
    assert who == ("receiver",)
    # a statement the sender never signed (forged by the receiver): the receiver
    forged = (ROWS, frame_signing.sign(new_key(), SEED, "node_a", ROWS, perturbed))
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
