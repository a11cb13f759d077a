"""The coordinator's recent events for the console: what its log says at INFO and above (nodes
joining and leaving, routes published, reports, requests replayed), kept in a bounded ring."""

from __future__ import annotations

import logging
import threading
from collections import deque

KEPT = 100
COORDINATOR_LOGGER = "seamline.coordinator"


class EventLog(logging.Handler):
    def __init__(self, kept: int = KEPT) -> None:
        super().__init__(level=logging.INFO)
        self._events: deque[dict[str, object]] = deque(maxlen=kept)
        self._guard = threading.Lock()
        self._count = 0

    def emit(self, record: logging.LogRecord) -> None:
        with self._guard:
            self._count += 1
            self._events.append({"seq": self._count, "time": record.created, "level": record.levelname.lower(),
                                 "message": record.getMessage()})  # fmt: skip

    def recent(self) -> list[dict[str, object]]:
        with self._guard:
            return list(self._events)

    @classmethod
    def attached(cls) -> EventLog:
        """A log of the coordinator's logger from now on (its level lowered to INFO if need be)."""
        logger = logging.getLogger(COORDINATOR_LOGGER)
        handler = next((h for h in logger.handlers if isinstance(h, cls)), None) or cls()
        if handler not in logger.handlers:
            logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        return handler
