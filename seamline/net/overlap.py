"""A link's large frames cross it while the stage computes.

A pipeline's stage 0 sends a long prompt on in chunks (``pipeline_head``) so that stage 1
computes chunk k while stage 0 computes chunk k + 1. A blocking send would hold stage 0 until
the chunk's bytes left (until stage 1 read them, once the socket's buffers are full), and a
stage that computes on the thread that reads its link would start taking chunk k + 1 off the
wire only once chunk k is computed. So ``SendBehind`` sends a large frame on a thread of its
own, and ``ReadAhead`` reads on while its consumer computes a large frame.

A small frame (a decode step's) goes as before, on the caller's thread, when nothing is queued
before it: a hand-off between threads would add to every token's round trip. Only socket work
moves to the helper threads, which exist while there is such work: a stage computes on its one
thread, whose OpenMP pool stays the process's only one (``runtime.openmp``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch

from seamline.net.frames import HiddenFrame, Row, encode_hidden
from seamline.net.link import Incoming, Link, LinkClosed
from seamline.net.messages import Message, encode_message

OVERLAP_BYTES = (
    64 << 10
)  # frames from this size on cross on a helper thread (a V4 decode row's is 32 KiB)
QUEUED_BYTES = (
    64 << 20
)  # what a sender queues, or a reader reads ahead, before it waits for its consumer

Buffers = Sequence[bytes | memoryview]
Failed = Callable[[list[int], Exception], None]


class SendBehind:
    """A link's sends, in the order made: a small one on the caller's thread when nothing is
    queued, the rest on a thread that lives while the queue holds frames. ``failed``: the
    requests of frames that a broken link dropped after their send had returned."""

    def __init__(self, link: Link, failed: Failed) -> None:
        self.link = link
        self.failed = failed
        self._cond = threading.Condition()
        self._queue: deque[tuple[Buffers, int, list[int]]] = deque()  # its head is being sent
        self._queued = 0  # bytes
        self._error: Exception | None = None

    def send_hidden(
        self,
        rows: list[Row],
        tensor: torch.Tensor,
        ids: torch.Tensor | None = None,
        signed: tuple[bytes, bytes] | None = None,
    ) -> None:
        self._put(encode_hidden(rows, tensor, ids, signed), [row.request for row in rows])

    def send_message(self, message: Message) -> None:
        self._put([encode_message(message)], [])

    def idle(self) -> bool:
        """Whether every frame has left (or was dropped with the link)."""
        with self._cond:
            return not self._queue

    def _put(self, buffers: Buffers, requests: list[int]) -> None:
        size = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)
        with self._cond:
            if self._error is not None:
                raise LinkClosed(f"link to {self.link.name} broke: {self._error}")
            if not self._queue and size < OVERLAP_BYTES:
                self.link.send_buffers(
                    buffers
                )  # under the lock: a send made meanwhile waits its turn
                return
            while self._queue and self._queued + size > QUEUED_BYTES and self._error is None:
                self._cond.wait()  # a slow link holds its sender back, as a blocking send did
            if self._error is not None:
                raise LinkClosed(f"link to {self.link.name} broke: {self._error}")
            self._queue.append((buffers, size, requests))
            self._queued += size
            if len(self._queue) == 1:
                threading.Thread(target=self._drain, name="seamline-send", daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self._cond:
                buffers = self._queue[0][0]
            try:
                self.link.send_buffers(buffers)
            except Exception as exc:  # the link is closed: what is queued behind is dropped too
                with self._cond:
                    self._error = exc
                    dropped = sorted({r for _, _, requests in self._queue for r in requests})
                    self._queue.clear()
                    self._queued = 0
                    self._cond.notify_all()
                self.failed(dropped, exc)
                return
            with self._cond:
                self._queued -= self._queue.popleft()[1]
                self._cond.notify_all()
                if not self._queue:
                    return


def frame_bytes(frame: object) -> int:
    """A hidden frame's tensor and ids bytes (0 for another frame: small)."""
    if not isinstance(frame, HiddenFrame):
        return 0
    return frame.tensor.nbytes + (frame.ids.nbytes if frame.ids is not None else 0)


class ReadAhead:
    """A link's frames for one consumer thread: read on that thread, except after it took a
    large frame, while a reader thread takes the next frames off the socket for it. The reader
    stops once the consumer waits on it (the burst is over), or QUEUED_BYTES are waiting."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._cond = threading.Condition()
        self._ready: deque[Incoming | Exception] = deque()
        self._queued = 0  # bytes
        self._reading = False  # a reader thread owns the link's reads
        self._wanted = False  # the consumer waits for the reader's next frame

    def recv(self) -> Incoming:
        """The next frame, in order; LinkClosed or FrameError as ``Link.recv`` raises them."""
        with self._cond:
            while not self._ready and self._reading:
                self._wanted = True
                self._cond.wait()
            self._wanted = False
            frame = self._ready.popleft() if self._ready else None
            if frame is not None:
                self._queued -= frame_bytes(frame)
        if frame is None:
            frame = self.link.recv()
        if isinstance(frame, Exception):
            raise frame
        if frame_bytes(frame) >= OVERLAP_BYTES:
            self._read_on()
        return frame

    def _read_on(self) -> None:
        with self._cond:
            if self._reading:
                return
            self._reading = True
        threading.Thread(target=self._read, name="seamline-read-ahead", daemon=True).start()

    def _read(self) -> None:
        while True:
            frame: Incoming | Exception
            try:
                frame = self.link.recv()
            except Exception as exc:  # the consumer raises it when it comes to it
                frame = exc
            with self._cond:
                self._ready.append(frame)
                self._queued += frame_bytes(frame)
                self._cond.notify_all()
                if isinstance(frame, Exception) or self._wanted or self._queued >= QUEUED_BYTES:
                    self._reading = False
                    return
