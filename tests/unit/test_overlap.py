"""A stage's large frames cross its links on helper threads (``net.overlap``): over a real
socket pair, every frame arrives whole and in the order sent, small ones and large ones mixed,
and a link that breaks with frames queued names their requests."""

from __future__ import annotations

import socket
import threading

import torch

from seamline.net.frames import HiddenFrame, Row
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import Ping
from seamline.net.overlap import OVERLAP_BYTES, ReadAhead, SendBehind

HIDDEN = 576


def _pair() -> tuple[Link, Link]:
    a, b = socket.socketpair()
    return Link(a, "stage 0"), Link(b, "stage 1")


def _rows(request: int, count: int) -> tuple[list[Row], torch.Tensor]:
    tensor = torch.arange(count * HIDDEN, dtype=torch.float32).reshape(count, HIDDEN) + request
    return [Row(request, 0, count, 0, 0)], tensor


def test_large_and_small_frames_arrive_whole_and_in_the_order_sent() -> None:
    sender, receiver = _pair()
    failed: list[list[int]] = []
    behind = SendBehind(sender, lambda requests, exc: failed.append(requests))
    counts = [1, 256, 1, 1, 512, 3, 256, 1]  # 256 rows of float32 is 576 KiB: over OVERLAP_BYTES
    assert 256 * HIDDEN * 4 >= OVERLAP_BYTES > HIDDEN * 4
    got: list[object] = []
    reader = ReadAhead(receiver)

    def read() -> None:
        for _ in range(len(counts) + 1):
            got.append(reader.recv())

    thread = threading.Thread(target=read)
    thread.start()
    for request, count in enumerate(counts):
        behind.send_hidden(*_rows(request, count))
    behind.send_message(Ping(nonce=7))
    thread.join(timeout=30)
    assert not thread.is_alive() and not failed
    frames = [f for f in got if isinstance(f, HiddenFrame)]
    assert [f.rows[0].request for f in frames] == list(range(len(counts)))
    for request, (frame, count) in enumerate(zip(frames, counts)):
        assert torch.equal(frame.tensor, _rows(request, count)[1])
    assert isinstance(got[-1], Ping) and got[-1].nonce == 7
    assert behind.idle()
    sender.close()
    receiver.close()


def test_a_link_that_breaks_under_queued_frames_names_their_requests() -> None:
    sender, receiver = _pair()
    failed: list[list[int]] = []
    done = threading.Event()

    def report(requests: list[int], exc: Exception) -> None:
        failed.append(requests)
        done.set()

    behind = SendBehind(sender, report)
    receiver.close()  # nobody reads: the socket's buffers fill, then the send fails
    try:
        for request in range(40):
            behind.send_hidden(*_rows(request, 512))
    except LinkClosed:
        pass  # a send after the break is refused at once
    assert done.wait(30)
    assert failed and failed[0] and all(isinstance(r, int) for r in failed[0])
    try:
        behind.send_hidden(*_rows(99, 1))
        raise AssertionError("a send on a broken link must raise LinkClosed")
    except LinkClosed:
        pass
    sender.close()


def test_a_read_ahead_reports_a_closed_link_when_it_comes_to_it() -> None:
    sender, receiver = _pair()
    reader = ReadAhead(receiver)

    def send() -> None:
        sender.send_hidden(*_rows(1, 512))  # large: the reader reads on behind it
        sender.send_hidden(*_rows(2, 1))
        sender.close()

    thread = threading.Thread(target=send)
    thread.start()
    assert reader.recv().rows[0].request == 1
    thread.join(timeout=30)
    assert reader.recv().rows[0].request == 2
    try:
        reader.recv()
        raise AssertionError("a closed link must raise LinkClosed")
    except LinkClosed:
        pass
    receiver.close()
