"""What the HTTP API asks of a caller before any work: an API key, a bounded body, and a bounded
number of requests in flight per key. An ASGI middleware, so a streamed answer counts as in
flight until its last byte, and a refused request never reaches a route.

Keys are compared in constant time. Without keys every caller is one anonymous caller (the
per-key limit then bounds them all together). ``/health`` is always open; the mesh's fragment
downloads take a member's fragment token, never an API key (their route checks it). The mesh's
administration takes the administrator's key, checked here from the headers before a byte of
the body is read. Every route's body is capped: the API's at ``--max-body-mb``, the others'
(open, administration: small JSON or none) at ``SMALL_BODY_BYTES``.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections import Counter
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from seamline.server.api_options import ApiLimits
from seamline.server.openai_schema import error_body

log = logging.getLogger("seamline.api")
OPEN_PATHS = (
    "/health",
    "/",
    "/console.js",
)  # the console's page and script hold no data: it asks for a key
OPEN_PREFIXES = ("/fragments/",)  # its route checks a member's token
ADMIN_PREFIX = "/api/admin/"  # mesh/control/admin.py's routes (which check the key again)
SMALL_BODY_BYTES = 64 << 10  # an open or administration route's body (an invite's options at most)
ANONYMOUS = ""


@dataclass
class _Refusal(Exception):
    status: int
    message: str
    type: str
    code: str
    headers: dict[str, str] = field(default_factory=dict)


class Guard:
    """The middleware: refuses before the app runs, counts what is in flight per key."""

    def __init__(self, app: ASGIApp, limits: ApiLimits) -> None:
        self.app = app
        self.limits = limits
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admin = self.limits.admin_key is not None and scope["path"].startswith(ADMIN_PREFIX)
        key: str | None = None  # an API caller's, counted in flight
        try:
            if admin or _is_open(scope["path"]):
                if admin:
                    self._check_admin(scope)  # before the body: a stranger's is never read
                receive = await self._read_body(scope, receive, SMALL_BODY_BYTES)
            else:
                key = self._caller(scope)
                receive = await self._read_body(scope, receive, self.limits.max_body_bytes)
                self._admit(key)
        except _Refusal as refusal:
            await _refuse(send, refusal)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if key is not None:
                self.in_flight[key] -= 1

    def _caller(self, scope: Scope) -> str:
        if not self.limits.keys:
            return ANONYMOUS
        given = _bearer(scope)
        for key in self.limits.keys:
            if given is not None and hmac.compare_digest(given.encode(), key.encode()):
                return key
        log.warning(
            "refused %s %s from %s: %s",
            scope["method"],
            scope["path"],
            _client(scope),
            "no API key" if given is None else "a wrong API key",
        )
        raise _Refusal(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer KEY` with a key this "
            "server was started with (--api-key).",
            "invalid_request_error",
            "invalid_api_key",
            {"WWW-Authenticate": "Bearer"},
        )

    def _check_admin(self, scope: Scope) -> None:
        given, key = _bearer(scope), self.limits.admin_key or ""
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            log.warning(
                "refused %s %s from %s: not the administrator's key",
                scope["method"],
                scope["path"],
                _client(scope),
            )
            raise _Refusal(
                401,
                "the administrator's key is required (admin.key in the mesh's state directory)",
                "invalid_request_error",
                "invalid_admin_key",
                {"WWW-Authenticate": "Bearer"},
            )

    def _admit(self, key: str) -> None:
        limit = self.limits.max_concurrent_per_key
        if limit is not None and self.in_flight[key] >= limit:
            raise _Refusal(
                429,
                f"this API key has {limit} requests in flight, the most this server takes at once "
                "per key; try again when one has finished",
                "rate_limit_error",
                "concurrency_limit",
            )
        self.in_flight[key] += 1

    async def _read_body(self, scope: Scope, receive: Receive, limit: int) -> Receive:
        """Read the whole body (chunked, or longer than it said) within ``limit``; a ``receive``
        that gives it to the app, then goes on with the connection (a client going away)."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return _replay([message], receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise _too_large(limit)
            more = message.get("more_body", False)
        return _replay(
            [{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive
        )


def _replay(first: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return first.pop(0) if first else await receive()

    return replayed


def _too_large(limit: int) -> _Refusal:
    return _Refusal(
        413,
        f"the request body is larger than {limit} bytes, the most this server takes",
        "invalid_request_error",
        "body_too_large",
    )


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def _bearer(scope: Scope) -> str | None:
    value = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


async def _refuse(send: Send, refusal: _Refusal) -> None:
    body = json.dumps(error_body(refusal.message, refusal.type, None, refusal.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in refusal.headers.items()]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
