"""Backend: what the HTTP API needs from whatever generates tokens (one process or a mesh).

The API speaks text; a backend speaks token ids. ``generate`` is an async iterator of token
ids that ends at a stop token or ``max_tokens``; closing it early (client gone, stop string
seen) cancels the request. ``LocalBackend`` runs the single-process Engine in a worker thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from seamline.runtime.engine import Engine
from seamline.runtime.sampling import SamplingParams
from seamline.text import TextCodec


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str = ""  # why not ready, shown in /health and in 503 errors


class Backend(Protocol):
    model_name: str
    codec: TextCodec
    context_length: int

    def readiness(self) -> Readiness: ...

    def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[int]: ...


_DONE = object()


class LocalBackend:
    """One process owns the whole model; requests run one at a time in a worker thread."""

    def __init__(self, engine: Engine, codec: TextCodec, model_name: str) -> None:
        self.engine = engine
        self.codec = codec
        self.model_name = model_name
        self.context_length = engine.context_length
        self._lock = threading.Lock()

    def readiness(self) -> Readiness:
        return Readiness(True)

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[int]:
        self.engine.check_prompt(prompt)
        params.validate()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancelled = threading.Event()

        def work() -> None:
            try:
                with self._lock:
                    for token in self.engine.generate(prompt, params):
                        if cancelled.is_set():
                            break
                        loop.call_soon_threadsafe(queue.put_nowait, token)
            except BaseException as exc:  # delivered to the awaiting request
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        threading.Thread(target=work, name="seamline-generate", daemon=True).start()
        try:
            while (item := await queue.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield int(item)  # type: ignore[call-overload]
        finally:
            cancelled.set()
