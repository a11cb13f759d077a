"""The input rows a stage of a checked mesh computed on, kept per request so that the coordinator
can check the stage on them (``mesh.control.verify``: it chooses one stage of a followed request
after every stage reported its digests, and asks the chosen one for its inputs).

A request's rows are kept for as long as the stage keeps its cache (until stage 0 forgets it:
a finished request's cache may still be forked for a prompt that begins alike, and the fork's
rows begin with the donor's). One row per cached position at most, so the kept rows of a stage
of more than a layer or two weigh less than the KV cache the scheduler's budget already bounds.
A forgotten request's rows are kept ``AFTER_FORGET_S`` more (at most ``AFTER_FORGET_BYTES`` of
them, the oldest let go first): stage 0 may evict a finished request's cache before the
coordinator, whose checks run behind the mesh, asks for its last rows, and a stage that cannot
show rows it computed on is at fault.
"""

from __future__ import annotations

import threading
import time

import torch

Segment = tuple[int, torch.Tensor]  # first position, the rows [tokens, ...] from there
AFTER_FORGET_S = 60.0  # beyond the coordinator's wait for rows (``verify.WAIT_S``) and its lag
AFTER_FORGET_BYTES = 256 << 20


class KeptInputs:
    def __init__(self) -> None:
        self._rows: dict[int, list[Segment]] = {}
        self._forgotten: dict[int, tuple[float, list[Segment]]] = {}  # oldest first
        self._lock = threading.Lock()  # kept on the stage's thread, read on its control thread

    def keep(self, request: int, position: int, rows: torch.Tensor) -> None:
        """``rows`` came in for ``request`` at ``position``...: whatever was kept from
        ``position`` on is replaced (the sequence started over, or went back)."""
        with self._lock:
            segments = _before(self._rows.get(request, []), position)
            segments.append((position, rows.clone()))  # not a view that holds the whole frame
            self._rows[request] = segments

    def fork(self, request: int, donor: int, positions: int) -> None:
        """``request`` begins with ``donor``'s first ``positions`` (a shared prefix)."""
        with self._lock:
            self._rows[request] = _before(self._rows.get(donor, []), positions)

    def forget(self, request: int) -> None:
        """Stage 0 let go of ``request``'s cache: its rows go after ``AFTER_FORGET_S``."""
        with self._lock:
            segments = self._rows.pop(request, None)
            if segments:
                self._forgotten[request] = (time.monotonic(), segments)
            self._let_go()

    def _let_go(self) -> None:
        """Forgotten rows past their time or over the cap (under ``_lock``)."""
        now, total = time.monotonic(), 0
        for request, (since, segments) in reversed(list(self._forgotten.items())):
            total += sum(rows.nbytes for _, rows in segments)
            if now - since > AFTER_FORGET_S or total > AFTER_FORGET_BYTES:
                del self._forgotten[request]

    def rows(self, request: int, start: int, end: int) -> torch.Tensor | None:
        """The rows of positions [start, end); None when they are not all kept."""
        with self._lock:
            self._let_go()
            segments = self._rows.get(request) or self._forgotten.get(request, (0.0, []))[1]
            parts = [
                rows[max(0, start - first) : max(0, end - first)]
                for first, rows in segments
                if first < end and first + rows.shape[0] > start
            ]
        if not parts or sum(p.shape[0] for p in parts) != end - start:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def requests(self) -> int:
        """Requests whose rows are held, forgotten ones too."""
        return len(self._rows) + len(self._forgotten)


def _before(segments: list[Segment], position: int) -> list[Segment]:
    """The parts of ``segments`` before ``position``."""
    kept = []
    for first, rows in segments:
        if first < position:
            kept.append((first, rows[: position - first]))
    return kept
