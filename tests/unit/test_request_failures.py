"""What a node does with a message it cannot take, and when a request stops being replayed.

A node refuses a frame from its coordinator that is over its cap or malformed without leaving
the link (the coordinator is trusted to stay in step: the payload is skipped or was read
whole); a request whose route is lost as it starts on it, twice, is ended with an error
instead of being replayed onto the next nodes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from seamline.mesh.control.mesh_backend import MeshBackend, RequestFailed
from seamline.mesh.control.mesh_state import NoMembers
from seamline.mesh.control.state_keeper import StateKeeper
from seamline.net.frames import LIMITS, FrameType, Oversized, header
from seamline.net.link import Link
from seamline.net.messages import Heartbeat, Open
from seamline.params import SamplingParams


def test_an_oversized_frame_is_skipped_and_the_link_stays_in_step() -> None:
    a, b = socket.socketpair()
    sender, receiver = Link(a, "coordinator"), Link(b, "node")
    size = LIMITS[FrameType.CONTROL] + 12345
    threading.Thread(
        target=lambda: (
            sender.send_raw(header(FrameType.CONTROL, size) + b"x" * size),
            sender.send_message(Heartbeat()),
        ),
        daemon=True,
    ).start()
    with pytest.raises(Oversized) as refused:
        receiver.recv()
    receiver.discard(refused.value.length)
    assert isinstance(receiver.recv(deadline_s=5), Heartbeat)
    sender.close()
    receiver.close()


def test_the_coordinator_refuses_to_send_an_open_a_node_would_not_take() -> None:
    from seamline.errors import RequestError
    from seamline.mesh.control.coordinator import Coordinator

    huge = SamplingParams(grammar="x" * LIMITS[FrameType.CONTROL])
    opening = Open(request=1, sampling=huge, prompt_len=3, context_length=64)
    coordinator = SimpleNamespace(pipeline=lambda: pytest.fail("nothing may be sent"))
    with pytest.raises(RequestError, match="more than the .* a node takes"):
        Coordinator.open_request(coordinator, opening, [1, 2, 3])  # type: ignore[arg-type]


class _Mesh(SimpleNamespace):
    """The coordinator as the backend sees it: it records opens and lets the test fail routes."""

    def __init__(self) -> None:
        ready = threading.Event()
        ready.set()
        super().__init__(
            on_tokens=None,
            on_failure=None,
            ready=ready,
            state="ready",
            plan_id=1,
            opened=[],
            keeper=StateKeeper(),
        )  # its events: the requests replayed
        self.open_request = lambda request, tokens: self.opened.append(request.request)
        self.close_request = lambda request: None


async def _next_or_error(stream: object) -> object:
    try:
        return await anext(stream)  # type: ignore[call-overload]
    except Exception as exc:
        return exc


def test_a_request_that_fails_the_nodes_it_starts_on_twice_is_ended() -> None:
    mesh = _Mesh()
    backend = MeshBackend(mesh, None, "m", 64)  # type: ignore[arg-type]

    async def scenario() -> object:
        stream = backend.generate([1, 2, 3], SamplingParams(max_tokens=4))
        outcome = asyncio.ensure_future(_next_or_error(stream))
        for attempt in (1, 2):
            while len(mesh.opened) < attempt:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.02)
            backend._fail(None, "node n0 left the mesh mid-request", "lost")
        return await outcome

    ended = asyncio.run(scenario())
    assert isinstance(ended, RequestFailed) and "failed as it started, 2 times" in str(ended)
    assert len(mesh.opened) == 2  # replayed once, then ended
    mesh.keeper.apply(
        NoMembers()
    )  # events apply in order: the replay posted before this one has been heard
    assert backend.report.events["request_replayed"] == 1


def test_a_replan_or_a_loss_after_the_first_token_still_replays() -> None:
    """Live growth re-plans without losing a node, and a node lost after the request drew a
    token is no sign against it: the request is replayed each time."""
    from seamline.net.frames import RowFlag, TokenRow

    mesh = _Mesh()
    backend = MeshBackend(mesh, None, "m", 64)  # type: ignore[arg-type]

    async def scenario() -> list[object]:
        stream = backend.generate([1, 2, 3], SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(anext(stream))
        for attempt, blame in ((1, "replanned"), (2, "replanned"), (3, "replanned")):
            while len(mesh.opened) < attempt:
                await asyncio.sleep(0.01)
            backend._fail(None, "the mesh re-planned", blame)
        while len(mesh.opened) < 4:
            await asyncio.sleep(0.01)
        backend._deliver([TokenRow(mesh.opened[-1], 3, 42, 0, 0)])
        tokens = [await first]
        second = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.02)
        backend._fail(None, "node n0 left the mesh mid-request", "lost")
        while len(mesh.opened) < 5:
            await asyncio.sleep(0.01)
        backend._fail(
            None, "node n1 left the mesh mid-request", "lost"
        )  # as it starts: once is no verdict
        while len(mesh.opened) < 6:
            await asyncio.sleep(0.01)
        backend._deliver([TokenRow(mesh.opened[-1], 4, 43, 0, 0, int(RowFlag.DONE))])
        tokens.append(await second)
        return tokens

    events = asyncio.run(scenario())
    assert [e.token for e in events] == [42, 43]  # type: ignore[attr-defined]
    assert [e.finish_reason for e in events] == [None, "length"]  # type: ignore[attr-defined]


def test_a_request_opened_as_its_route_goes_waits_without_spending_its_replays() -> None:
    """Between a node's loss and the re-plan the mesh still reads ready, but its route names a
    node gone and an open fails at once: the request waits and opens again, however many times,
    and counts no replay (it looped through its 8 replays in 0.1 s, `bench chaos` lost 39 so)."""
    from seamline.mesh.control.coordinator import StartupError
    from seamline.net.frames import RowFlag, TokenRow

    mesh = _Mesh()
    tries: list[int] = []

    def open_request(request: Open, tokens: list[int]) -> None:
        tries.append(request.request)
        if len(tries) <= 12:
            raise StartupError("the mesh is not ready: node n1 left")
        mesh.opened.append(request.request)

    mesh.open_request = open_request
    backend = MeshBackend(mesh, None, "m", 64)  # type: ignore[arg-type]

    async def scenario() -> object:
        stream = backend.generate([1, 2, 3], SamplingParams(max_tokens=1))
        first = asyncio.ensure_future(_next_or_error(stream))
        while not mesh.opened and not first.done():
            await asyncio.sleep(0.01)
        if first.done():
            return first.result()  # given up
        backend._deliver([TokenRow(mesh.opened[-1], 3, 42, 0, 0, int(RowFlag.DONE))])
        return await first

    event = asyncio.run(scenario())
    assert getattr(event, "token", None) == 42, event
    mesh.keeper.apply(NoMembers())
    assert backend.report.events.get("request_replayed", 0) == 0


def test_a_request_whose_opens_keep_failing_while_the_mesh_reads_ready_ends_at_the_deadline() -> (
    None
):
    """An open that fails each time while the mesh reads ready is waited on no longer than a
    lost route: the request ends with the reason once the replay deadline has passed."""
    from seamline.mesh.control.coordinator import StartupError

    mesh = _Mesh()

    def open_request(request: Open, tokens: list[int]) -> None:
        raise StartupError("the mesh is not ready: node n1 left")

    mesh.open_request = open_request
    backend = MeshBackend(mesh, None, "m", 64, replay_deadline_s=0.5)  # type: ignore[arg-type]
    began = time.monotonic()
    got = asyncio.run(_next_or_error(backend.generate([1, 2, 3], SamplingParams(max_tokens=1))))
    assert isinstance(got, RequestFailed) and "node n1 left" in str(got), got
    assert "could not serve again within" in str(got) and time.monotonic() - began < 5
