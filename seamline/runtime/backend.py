"""Backend: what the HTTP API needs from whatever generates tokens (one process or a mesh).

The API speaks text; a backend speaks tokens. ``generate`` is an async iterator of
``TokenEvent``s whose last carries the finish reason its draw gave ("stop": a stop token,
which is not output; "length": max_tokens or the context), after which it ends; closing it
early (client gone, stop string seen) cancels the request. ``LocalBackend`` batches
concurrent requests on one process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from seamline.params import SamplingParams
from seamline.runtime.batch_loop import BatchLoop
from seamline.runtime.core import EngineCore, LocalExecutor
from seamline.runtime.engine import Engine
from seamline.runtime.grammar import TokenMasks
from seamline.runtime.prefix_cache import PREFIX_CACHE_BYTES
from seamline.runtime.reports import MeshReport, NodeReport
from seamline.runtime.sampling import TokenEvent
from seamline.runtime.speculation import Speculation
from seamline.text import TextCodec

LOCAL_NODE = "local"  # the one node of a single-process server, in /metrics


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str = ""  # why not ready, shown in /health and in 503 errors
    waits: bool = (
        False  # not ready, but a new request is taken and waits (a mesh healing after a loss)
    )


class Backend(Protocol):
    model_name: str
    codec: TextCodec
    context_length: int

    def readiness(self) -> Readiness: ...

    def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]: ...


class LocalBackend:
    """One process owns the whole model; concurrent requests share batched steps (``BatchLoop``),
    and a prompt that begins as an earlier one reuses its KV (the scheduler's prefix cache)."""

    def __init__(
        self,
        engine: Engine,
        codec: TextCodec,
        model_name: str,
        max_running: int = 64,
        max_waiting: int = 256,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        kv_budget_bytes: int | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        self.engine = engine
        self.codec = codec
        self.model_name = model_name
        self.context_length = engine.context_length
        # the served tokenizer's (the API compiled against it): the engine's own where it has them
        masks = engine.masks or TokenMasks(codec.tokenizer.to_str)
        self.core = EngineCore.local(
            engine.stage,
            engine.context_length,
            masks,
            max_running=max_running,
            max_waiting=max_waiting,
            kv_budget_bytes=kv_budget_bytes,
            prefix_cache_bytes=prefix_cache_bytes,
            speculation=speculation,
        )
        self.loop = BatchLoop(self.core)

    def readiness(self) -> Readiness:
        return Readiness(True)

    def close(self) -> None:
        """Stop its batch loop (before the process exits: no step may be mid-way then)."""
        self.loop.close()

    def report(self) -> MeshReport:
        """For /metrics: this process is the one node."""
        executor = self.core.executor
        assert isinstance(executor, LocalExecutor)
        steps = executor.decode_steps
        step = executor.decode_seconds / steps if steps else None
        speculated = self.core.scheduler.speculated
        return MeshReport(
            [NodeReport(LOCAL_NODE, True, step, self.core.scheduler.kv_used())],
            speculation=speculated,
        )

    async def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """The request's tokens; its prompt and parameters are the API's, validated there."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        request = self.loop.submit(
            prompt, params, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)
        )
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, TokenEvent)
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.loop.cancel(request)  # a no-op once it finished
