"""A client that leaves before its answer: a route's waits watch for it.

While a route awaits a request's first token (or, not streaming, its whole answer) it sends
nothing, so nothing would notice the client going away: the wait is raced against the ASGI
``http.disconnect``, and cancelled when that comes first. The backend's wait is cancelled
with it, so a request no one waits for leaves the backend's queue unprefilled, and a mesh
that heals does not replay it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


async def unless_gone(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, ``work``'s result), or (False, None) when the client went away first (``work``
    then cancelled). The request's body must have been read."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        return (True, task.result()) if task.done() else (False, None)
    finally:
        for pending in (task, gone):
            pending.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (after its body, nothing else can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
