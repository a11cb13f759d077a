"""Bytes sent in parts over a member's control link (``net.byte_parts``)."""

from __future__ import annotations

import pytest

from seamline.net.byte_parts import PART_CHARS, gather, split


def test_parts_come_together_in_order_to_the_bytes_sent() -> None:
    raw = bytes(range(256)) * 400  # 102400 bytes: four parts
    parts = split(raw)
    assert [at for at, _ in parts] == [0, 30720, 61440, 92160]
    assert all(len(text) <= PART_CHARS for _, text in parts)
    arriving = bytearray()
    got = [gather(arriving, at, text, len(raw)) for at, text in parts]
    assert got[:-1] == [None, None, None] and got[-1] == raw and not arriving


def test_a_part_out_of_turn_or_past_the_size_is_refused() -> None:
    parts = split(b"x" * 100, size=40)
    with pytest.raises(ValueError, match="from byte 40, where 0 came"):
        gather(bytearray(), *parts[1], 100)
    with pytest.raises(ValueError, match="50 bytes where 30 are expected"):
        gather(bytearray(), 0, split(b"y" * 50)[0][1], 30)
    with pytest.raises(ValueError):
        gather(bytearray(), 0, "not base64!", 100)
