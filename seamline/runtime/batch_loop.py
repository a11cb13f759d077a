"""One thread drives an engine core (``EngineCore``); requests come from any thread and get
their token events back through a callback, so concurrent requests share steps instead of
taking turns.

A request cancelled while it waits is never prefilled; one cancelled while it runs frees its
cache at the next step boundary. A step that raises ends every request it carried with that
error and the loop goes on serving new ones.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from seamline.params import SamplingParams
from seamline.runtime.core import EngineCore
from seamline.runtime.scheduler import SequenceState

log = logging.getLogger(__name__)

Deliver = Callable[
    [object], None
]  # gets each TokenEvent (the last with its finish reason), or an exception


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    deliver: Deliver
    sequence: SequenceState | None = field(default=None, init=False)  # set once the loop adds it


class BatchLoop:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self._cond = threading.Condition()
        self._new: list[Request] = []
        self._cancelled: list[Request] = []
        self._live: dict[SequenceState, Request] = {}
        self._thread: threading.Thread | None = None
        self._closing = False

    def submit(self, prompt: list[int], params: SamplingParams, deliver: Deliver) -> Request:
        request = Request(list(prompt), params, deliver)
        with self._cond:
            self._new.append(request)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="seamline-batch", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return request

    def cancel(self, request: Request) -> None:
        with self._cond:
            self._cancelled.append(request)
            self._cond.notify()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after the step it is in (the process may exit while no step runs);
        requests still running get no more tokens."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._new or self._cancelled or not self.scheduler.idle or self._closing
                ):
                    self._cond.wait()
                if self._closing:
                    return
                new, self._new = self._new, []
                cancelled, self._cancelled = self._cancelled, []
            self._take(new, cancelled)
            self._step()

    def _take(self, new: list[Request], cancelled: list[Request]) -> None:
        gone = set(cancelled)
        for request in new:
            if request in gone:
                continue  # abandoned while queued: never prefilled
            try:
                request.sequence = self.scheduler.add(request.prompt, request.params)
            except Exception as exc:  # a bad request ends alone
                _send(request, exc)
                continue
            self._live[request.sequence] = request
        for request in cancelled:
            if request.sequence is not None and self._live.pop(request.sequence, None) is not None:
                self.scheduler.cancel(request.sequence)

    def _step(self) -> None:
        try:
            emissions = self.core.step() or []
        except Exception as exc:
            log.exception("a batched step failed; its requests end with the error")
            for sequence, request in list(self._live.items()):
                self.scheduler.cancel(sequence)
                _send(request, exc)
            self._live.clear()
            return
        for emission in emissions:
            request = self._live.get(emission.sequence)
            if request is None:
                continue
            if emission.event is None:  # the draw failed: the request alone ends, with its error
                del self._live[emission.sequence]
                _send(request, emission.error)
                continue
            delivered = _send(request, emission.event)
            if (
                emission.event.finish_reason is not None
            ):  # its last (a window may give several in a step)
                del self._live[emission.sequence]
            elif not delivered:  # its receiver is gone
                del self._live[emission.sequence]
                self.scheduler.cancel(emission.sequence)


def _send(request: Request, item: object) -> bool:
    """Deliver ``item``; False when the receiver cannot take it (its event loop closed)."""
    try:
        request.deliver(item)
        return True
    except Exception:
        log.debug("a request's receiver is gone", exc_info=True)
        return False
