"""Socket I/O with a total deadline, on a socket whose timeout is never set.

A link's socket has one reader and several writers at once, and a socket's timeout applies to
both directions, so links leave it in blocking mode: a send waits for room with ``poll`` and
sends with ``MSG_DONTWAIT``, a read with a deadline waits for data with ``poll``. A deadline
here is the time all the bytes are allowed, not the time between two of them, so a peer that
drips bytes cannot stretch it. (On a socket in timeout mode, as a lockstep comm's, a call may
also wait up to that timeout: the deadline is then met within it.)
"""

from __future__ import annotations

import errno
import math
import select
import socket
import time
from collections.abc import Callable, Sequence

Buffer = bytes | bytearray | memoryview


def left(deadline: float) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` time); 0 once it has passed."""
    return max(0.0, deadline - time.monotonic())


def wait(sock: socket.socket, writing: bool, deadline: float) -> None:
    """Return once ``sock`` has data to read (or room to write), or has failed (the call that
    follows says how); TimeoutError when ``deadline`` comes first."""
    fileno = sock.fileno()
    if fileno < 0:
        raise OSError(errno.EBADF, "the socket is closed")
    poller = select.poll()
    poller.register(fileno, select.POLLOUT if writing else select.POLLIN)
    while True:
        remaining = left(deadline)
        if poller.poll(math.ceil(remaining * 1000)):  # ready at the deadline is still in time
            return
        if remaining <= 0:
            raise TimeoutError("the deadline passed")


def send_by(
    sock: socket.socket,
    buffers: Sequence[Buffer],
    deadline: float,
    took: Callable[[], None] | None = None,
) -> None:
    """Send every byte of ``buffers`` by ``deadline``, or TimeoutError: the stream may then end
    mid-frame, so the caller closes it. A send with room in the kernel's buffer (the common
    case) is one ``sendmsg``, as without a deadline. ``took`` is called whenever the kernel
    takes bytes (a peer that reads nothing stops that)."""
    try:  # the fast path: the buffers as they are, all taken at once
        sent = sock.sendmsg(buffers, [], socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        sent = 0
    views = [view for view in (memoryview(b).cast("B") for b in buffers) if view.nbytes]
    while views:
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if not views:
            return
        views[0] = views[0][sent:]
        if took is not None and sent:
            took()
        wait(sock, True, deadline)
        try:
            sent = sock.sendmsg(views, [], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
