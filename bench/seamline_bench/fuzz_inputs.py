"""Inputs for `seamline bench fuzz`: random bytes, truncations, oversized length fields, and valid
frames or requests with one field mutated. Seeded, so a run can be replayed."""

from __future__ import annotations

import json
import random
import struct
from typing import Any

import torch

from seamline.net.frames import (
    HEADER,
    MAGIC,
    VERSION,
    FrameType,
    Row,
    TokenRow,
    encode_hidden,
    encode_tokens,
    header,
)
from seamline.net.messages import Message, encode_message

WEIRD: tuple[Any, ...] = (
    None,
    True,
    -1,
    0,
    1,
    2**31,
    2**63,
    -(2**63),
    1e308,
    -1e-308,
    "",
    "x" * 5000,
    "\u0000",
    "\ud7ff" * 3,
    [],
    [1] * 300,
    {},
    {"a": {"b": {"c": []}}},
    3.5,
    "nan",
    "1e9999",
)


class Inputs:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def garbage(self, limit: int = 2048) -> bytes:
        return self.rng.randbytes(self.rng.randrange(1, limit))

    def broken(self, frame: bytes) -> bytes:
        """The frame truncated, with bytes flipped, with an oversized length field, or trailed by garbage."""
        pick = self.rng.randrange(4)
        if pick == 0 and len(frame) > 1:
            return frame[: self.rng.randrange(1, len(frame))]
        if pick == 1:
            data = bytearray(frame)
            for _ in range(self.rng.randrange(1, 4)):
                data[self.rng.randrange(len(data))] = self.rng.randrange(256)
            return bytes(data)
        if pick == 2:
            kind = self.rng.choice([FrameType.CONTROL, FrameType.HIDDEN, FrameType.TOKEN, 0, 9])
            length = self.rng.choice([2**32 - 1, 2**31, 1 << 28, 257 << 20, 1 << 21])
            return HEADER.pack(MAGIC, VERSION, int(kind), length) + frame[HEADER.size :][:64]
        return frame + self.garbage(64)

    def mutated(self, value: Any) -> Any:
        """``value`` (JSON-like) with one field replaced, deleted or added."""
        if isinstance(value, dict) and value:
            out = dict(value)
            key = self.rng.choice(list(out))
            pick = self.rng.randrange(4)
            if pick == 0:
                del out[key]
            elif pick == 1:
                out[self.rng.choice([key + "x", "kind", "__proto__", "\u00ff"])] = self.rng.choice(
                    WEIRD
                )
            elif pick == 2 and isinstance(out[key], (dict, list)) and out[key]:
                out[key] = self.mutated(out[key])
            else:
                out[key] = self.rng.choice(WEIRD)
            return out
        if isinstance(value, list) and value:
            out_list = list(value)
            i = self.rng.randrange(len(out_list))
            out_list[i] = (
                self.mutated(out_list[i])
                if isinstance(out_list[i], (dict, list))
                else self.rng.choice(WEIRD)
            )
            return out_list
        return self.rng.choice(WEIRD)

    def control(self, message: Message) -> bytes:
        """A control frame: the message with one field mutated (the JSON as sent, valid or not)."""
        body = json.dumps(self.mutated(json.loads(message.model_dump_json()))).encode()
        return header(FrameType.CONTROL, len(body)) + body

    def valid_control(self, message: Message) -> bytes:
        return encode_message(message)

    def request_id(self) -> int:
        return self.rng.choice([self.rng.getrandbits(63), 0, 1, 2**64 - 1])

    def hidden(self, hidden_size: int) -> bytes:
        """A HIDDEN frame for requests no one opened, with one header or row field mutated."""
        rows = [
            Row(
                self.request_id(),
                self.rng.choice([0, 1, 7, 2**32 - 1]),
                1,
                self.rng.getrandbits(64),
                self.rng.getrandbits(64),
                self.rng.choice([0, 1, 2, 3, 4, 255]),
            )
            for _ in range(self.rng.randrange(1, 4))
        ]
        buffers = encode_hidden(rows, torch.zeros(len(rows), hidden_size))
        frame = bytearray(b"".join(bytes(b) for b in buffers))
        field = self.rng.randrange(6)
        offset = HEADER.size
        if field == 0:
            struct.pack_into(
                "<H", frame, offset, self.rng.choice([0, 4096, 4097, 65535])
            )  # row count
        elif field == 1:
            frame[offset + 2] = self.rng.randrange(256)  # dtype code
        elif field == 2:
            frame[offset + 3] = self.rng.randrange(256)  # ndim
        elif field == 3:
            struct.pack_into("<I", frame, offset + 4, self.rng.getrandbits(32))  # shape[0]
        elif field == 4:
            struct.pack_into("<I", frame, offset + 8, self.rng.getrandbits(32))  # shape[1]
        return bytes(frame)

    def tokens(self) -> bytes:
        rows = [
            TokenRow(
                self.request_id(),
                self.rng.getrandbits(32),
                self.rng.getrandbits(32),
                self.rng.getrandbits(64),
                self.rng.getrandbits(64),
                self.rng.randrange(16),
            )
            for _ in range(self.rng.randrange(1, 4))
        ]
        frame = encode_tokens(rows)
        return frame if self.rng.random() < 0.7 else self.broken(frame)

    def http_body(self, base: dict[str, Any]) -> bytes:
        pick = self.rng.randrange(10)
        if pick == 0:
            return self.garbage()
        body = json.dumps(self.mutated(base)).encode()
        return self.broken(body) if pick == 1 else body

    def http_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for _ in range(self.rng.randrange(3)):
            name = self.rng.choice(
                ["Content-Type", "Authorization", "X-" + self.garbage(8).hex(), "Range", "Accept"]
            )
            headers[name] = self.rng.choice(
                [
                    "application/json",
                    "text/plain",
                    "Bearer " + self.garbage(12).hex(),
                    "bytes=0-",
                    "bytes=999999999-",
                    "bytes=5-1",
                    "bytes=-1,-2,-3",
                    "*/*",
                    "x" * 4000,
                ]
            )
        return headers
