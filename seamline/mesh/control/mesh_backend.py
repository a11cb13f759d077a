"""MeshBackend: the API's Backend over a stage pipeline run by the coordinator.

Each request is mirrored to every stage (open/close) and its prompt goes to stage 0; the
last stage's tokens arrive on its control link and are routed to the waiting request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
from collections.abc import AsyncIterator

from seamline.errors import OverloadedError, RequestError, SeamlineError
from seamline.mesh.control.coordinator import Coordinator
from seamline.net.frames import RowFlag, TokenRow
from seamline.net.messages import Open, Prompt
from seamline.params import SamplingParams
from seamline.runtime.sampling import request_seed
from seamline.runtime.backend import Readiness
from seamline.text import TextCodec


class RequestFailed(SeamlineError):
    """A stage failed or left while the request was in flight."""


MAX_REQUESTS = 320  # in flight at once (the single-process server: 64 running + 256 waiting)


class MeshBackend:
    def __init__(self, coordinator: Coordinator, codec: TextCodec, model_name: str, context_length: int,
                 max_requests: int = MAX_REQUESTS) -> None:  # fmt: skip
        self.coordinator = coordinator
        self.max_requests = max_requests
        self.codec = codec
        self.model_name = model_name
        self.context_length = context_length
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[object]]] = {}
        self._lock = threading.Lock()
        coordinator.on_tokens = self._deliver
        coordinator.on_failure = self._fail

    def readiness(self) -> Readiness:
        ready = self.coordinator.ready.is_set()
        return Readiness(ready, "" if ready else self.coordinator.state)

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[int]:
        params.validate()
        if not prompt or len(prompt) >= self.context_length:
            raise RequestError(f"the prompt has {len(prompt)} tokens; the model's context is {self.context_length}")
        queue: asyncio.Queue[object] = asyncio.Queue()
        with self._lock:
            if len(self._waiting) >= self.max_requests:
                raise OverloadedError(f"{len(self._waiting)} requests are already in flight; try again later")
            request = _new_id(self._waiting)
            self._waiting[request] = (asyncio.get_running_loop(), queue)
        spec = dataclasses.replace(params, seed=request_seed(params.seed), stop_strings=())  # stop strings stay here
        try:
            self.coordinator.open_request(
                Open(request=request, sampling=spec, prompt_len=len(prompt), context_length=self.context_length),
                Prompt(request=request, tokens=tuple(prompt)),
            )
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                assert isinstance(item, TokenRow)
                if item.flags & RowFlag.STOPPED:
                    return
                yield item.token
                if item.flags & RowFlag.DONE:
                    return
        finally:
            with self._lock:
                self._waiting.pop(request, None)
            self.coordinator.close_request(request)

    def _deliver(self, rows: list[TokenRow]) -> None:
        for row in rows:
            self._put(row.request, row)

    def _fail(self, request: int | None, reason: str, blame: str) -> None:
        with self._lock:
            targets = list(self._waiting) if request is None else [request]
        error = {"request": RequestError, "load": OverloadedError}.get(blame, RequestFailed)
        for target in targets:
            self._put(target, error(reason))

    def _put(self, request: int, item: object) -> None:
        with self._lock:
            waiting = self._waiting.get(request)
        if waiting is not None:
            loop, queue = waiting
            loop.call_soon_threadsafe(queue.put_nowait, item)


def _new_id(taken: dict[int, object]) -> int:
    """A request id no one can guess (a peer that could would forge its frames), none in use."""
    while (request := secrets.randbits(63)) in taken:
        pass
    return request
