"""StateKeeper: applies the coordinator's events (``mesh_state.apply``) one at a time, on one
thread of its own, and hands each event with the state it led to to every listener.

A thread that applies an event waits until it is applied, so it reads its own change at once;
a listener runs on the keeper's thread (it must not wait on the coordinator). ``ready`` mirrors
``state.ready`` as an ``Event`` to wait on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from seamline.mesh.control.mesh_state import Event, MeshState, apply

log = logging.getLogger("seamline.coordinator")
Listener = Callable[[Event, MeshState], None]


class StateKeeper:
    def __init__(self, initial: MeshState | None = None) -> None:
        self.current = initial or MeshState()
        self.ready = threading.Event()
        self._listeners: list[Listener] = [_log]
        self._queue: queue.SimpleQueue[tuple[Event, Future[MeshState] | None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="mesh-state")
        self._thread.start()

    def listen(self, listener: Listener) -> None:
        """``listener`` sees every event applied from now on (on the keeper's thread)."""
        self._queue.put((_Listen(listener), None))

    def apply(self, event: Event) -> MeshState:
        """Apply ``event`` and return the state it led to."""
        if threading.current_thread() is self._thread:
            return self._apply(event)
        done: Future[MeshState] = Future()
        self._queue.put((event, done))
        return done.result()

    def post(self, event: Event) -> None:
        """Apply ``event`` without waiting for it (from a thread that must not block)."""
        self._queue.put((event, None))

    def _run(self) -> None:
        while True:
            event, done = self._queue.get()
            try:
                state = self._apply(event)
            except (
                Exception
            ) as exc:  # a malformed event: the caller hears of it, the keeper goes on
                if done is not None:
                    done.set_exception(exc)
                continue
            if done is not None:
                done.set_result(state)

    def _apply(self, event: Event) -> MeshState:
        if isinstance(event, _Listen):
            self._listeners.append(event.listener)
            return self.current
        self.current = state = apply(self.current, event)
        if state.ready:
            self.ready.set()
        else:
            self.ready.clear()
        for listener in self._listeners:
            try:
                listener(event, state)
            except Exception:  # one listener's fault costs the others nothing
                log.exception("a listener of the mesh's events failed on %s", event.kind)
        return state


class _Listen(Event):
    """Adds a listener in order with the events (so it misses none applied after it)."""

    kind = "listen"

    def __init__(self, listener: Listener) -> None:
        self.listener = listener


def _log(event: Event, state: MeshState) -> None:
    level = event.level_in(state)
    if log.isEnabledFor(level):
        log.log(level, "%s", event.describe(state))
