"""The console's feed: the mesh's recent events (``mesh_state``) at INFO and above, as the
coordinator applied them (nodes joining and leaving, plans, routes published, reports, requests
replayed), kept in a bounded ring."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from seamline.mesh.control.mesh_state import Event, MeshState

KEPT = 100


class EventFeed:
    """A listener of the coordinator's ``StateKeeper``."""

    def __init__(self, kept: int = KEPT) -> None:
        self._events: deque[dict[str, object]] = deque(maxlen=kept)
        self._guard = threading.Lock()
        self._count = 0

    def __call__(self, event: Event, state: MeshState) -> None:
        level = event.level_in(state)
        if level < logging.INFO:
            return
        with self._guard:
            self._count += 1
            self._events.append(
                {
                    "seq": self._count,
                    "time": time.time(),
                    "kind": event.kind,
                    "level": logging.getLevelName(level).lower(),
                    "message": event.describe(state),
                }
            )

    def recent(self) -> list[dict[str, object]]:
        with self._guard:
            return list(self._events)
