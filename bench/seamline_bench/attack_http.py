"""Attackers on the OpenAI API and administration (`seamline bench fuzz`'s ``attacks``), each
sending its request again and again for ``duration_s`` on one connection (moved here from
tests/api/test_api_edge.py):

- ``oversize_logit_bias``: a chat request with ~1.7 MB of ``logit_bias`` (100,000 entries);
- ``oversize_schema``: a 1.2 MB schema description, as ``response_format`` and as a tool;
- ``admin_body``: an invite request with a wrong administrator's key and a 50 MB chunked body.

Each must be refused (400 naming the field; 401 without the body read) every time, quickly.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx

MB = 1 << 20
CHAT: dict[str, Any] = {
    "model": "default",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
}
BIG_SCHEMA = {"type": "object", "description": "x" * 1_200_000}


def _repeat(
    send: Callable[[httpx.Client], httpx.Response],
    api: str,
    duration_s: float,
    refused: Callable[[httpx.Response], bool],
) -> dict[str, Any]:
    """Send until ``duration_s`` has passed: the answers' statuses, how many were refusals as
    ``refused`` says, the slowest answer."""
    statuses: Counter[str] = Counter()
    good = sent = 0
    slowest = 0.0
    began = time.monotonic()
    with httpx.Client(base_url=api, timeout=60) as client:
        while time.monotonic() - began < duration_s:
            started = time.monotonic()
            try:
                reply = send(client)
                statuses[str(reply.status_code)] += 1
                good += refused(reply)
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
            sent += 1
            slowest = max(slowest, time.monotonic() - started)
    return {
        "requests": sent,
        "statuses": dict(statuses),
        "refused": sent > 0 and good == sent,
        "slowest_answer_s": round(slowest, 3),
    }


def _param(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["param"])
    except (ValueError, KeyError, TypeError):
        return ""


def oversize_logit_bias(target: dict[str, Any], duration_s: float) -> dict[str, Any]:
    huge = {str(t): 1.0 for t in range(100_000, 200_000)}  # ~1.7 MB of JSON

    def send(client: httpx.Client) -> httpx.Response:
        return client.post("/v1/chat/completions", json={**CHAT, "logit_bias": huge})

    return _repeat(
        send,
        target["api"],
        duration_s,
        lambda r: r.status_code == 400 and _param(r) == "logit_bias",
    )


def oversize_schema(target: dict[str, Any], duration_s: float) -> dict[str, Any]:
    bodies = [
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": BIG_SCHEMA},
            },
        },
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": BIG_SCHEMA}}],
        },
    ]
    turn = [0]

    def send(client: httpx.Client) -> httpx.Response:
        turn[0] += 1
        return client.post("/v1/chat/completions", json=bodies[turn[0] % 2])

    fields = ("response_format", "tools[0].function.parameters")
    return _repeat(
        send, target["api"], duration_s, lambda r: r.status_code == 400 and _param(r) in fields
    )


def admin_body(target: dict[str, Any], duration_s: float) -> dict[str, Any]:
    def chunks(total: int) -> Iterator[bytes]:  # no Content-Length: streamed as it is made
        yield b'{"uses": 1, "pad": "'
        for _ in range(total // MB):
            yield b"x" * MB
        yield b'"}'

    def send(client: httpx.Client) -> httpx.Response:
        headers = {"Content-Type": "application/json", "Authorization": "Bearer guess"}
        return client.post("/api/admin/invites", content=chunks(50 * MB), headers=headers)

    return _repeat(send, target["api"], duration_s, lambda r: r.status_code == 401)
