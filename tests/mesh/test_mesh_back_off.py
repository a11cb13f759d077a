"""A frame a stage refuses fails its request's attempt at once, and the request replays; a member
that keeps saying its stage failed waits longer each time before it is planned again.

One mesh over loopback: the coordinator and node0 (which could hold the whole model) are
`seamline` processes; member1 is a real ``Node`` run in this process, holding at most half the
model and reporting a machine of its own, so the mesh plans it in beside node0 (and can serve
without it). The test changes member1 as an attacker or a broken build would: it corrupts one
incoming row (its own stage refuses it), or it reports its stage failed on every request.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from seamline.mesh.node import membership
from seamline.mesh.node.process import Node, NodeOptions
from seamline.mesh.protocol.invite import Invite
from seamline.net.frames import HiddenFrame, TokenFrame
from seamline.net.link import LinkClosed
from seamline.net.messages import Failure, Open
from seamline.server.demo import memory_cap_gb
from tests.support.another_machine import dial_from
from tests.support.mesh_harness import MeshProcesses

CONTEXT = 1024
MEMBER = "member1"  # the member run in this process
QUESTION = "Name three rivers in Europe and one fact about each."
TOKENS = 24
REPLAYED_WITHIN_S = 2.0
FLAP_WINDOW_S = 40.0  # watched after the member first says its stage failed


@dataclass
class Tampered:
    """member1, and what the test makes it do."""

    mesh: MeshProcesses
    node: Node
    corrupt_next: threading.Event = field(default_factory=threading.Event)
    refused_at: list[float] = field(default_factory=list)
    flapping: threading.Event = field(default_factory=threading.Event)
    flapped: list[float] = field(default_factory=list)


@pytest.fixture(scope="module")
def tampered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tampered]:
    root = tmp_path_factory.mktemp("back-off")
    mesh = MeshProcesses(root, nodes=2, serve_args=("--context", str(CONTEXT))).start(join=False)
    honest = membership.local_resources
    membership.local_resources = lambda options: honest(options).model_copy(
        update={"host": "another-host"}
    )  # its CPUs are its own: the plan with it is faster, so it is planned in
    addresses = pytest.MonkeyPatch()
    dial_from(addresses)  # from an address of its own too: a name alone grants no machine
    try:
        mesh.join("node0")
        options = NodeOptions(
            max_memory_bytes=int(memory_cap_gb(None, 2, CONTEXT) * (1 << 30)),
            node_id=MEMBER,
            cache_dir=root / MEMBER,
            progress=False,
        )
        made = Tampered(mesh, Node(Invite.decode(mesh.token), options))
        _tamper(made)
        made.node.join()
        threading.Thread(target=made.node.serve, daemon=True).start()
        stages = [s["node_id"] for s in mesh.wait_ready()["stages"]]
        assert MEMBER in stages, f"the mesh planned {stages}: member1 must serve for these tests"
        yield made
    finally:
        membership.local_resources = honest
        addresses.undo()
        mesh.stop()
        (root / "serve.log").write_text("".join(mesh.output))  # kept when a test failed


def _tamper(made: Tampered) -> None:
    """member1's frames and opens pass through the test on their way in."""
    node = made.node
    on_control, on_frame = node._on_control, node._on_frame

    def control(message: Any) -> None:
        if isinstance(message, Open):
            _maybe_flap(made, message.request)
        on_control(message)

    def frame(incoming: Any, peer: str, role: str) -> None:
        if isinstance(incoming, Open):
            _maybe_flap(made, incoming.request)
        if isinstance(incoming, (HiddenFrame, TokenFrame)) and made.corrupt_next.is_set():
            made.corrupt_next.clear()
            first = dataclasses.replace(
                incoming.rows[0], hash_before=incoming.rows[0].hash_before ^ 1
            )
            incoming = dataclasses.replace(incoming, rows=(first, *incoming.rows[1:]))
            made.refused_at.append(time.monotonic())
        on_frame(incoming, peer, role)

    node._on_control, node._on_frame = control, frame  # type: ignore[method-assign]


def _maybe_flap(made: Tampered, request: int) -> None:
    """While flapping, member1 says its stage failed on every request it is sent."""
    if not made.flapping.is_set():
        return

    def report() -> None:
        control = made.node.control
        try:
            if control is not None:
                control.send_message(Failure(request=request, reason="this stage failed"))
                made.flapped.append(time.monotonic())
        except LinkClosed:
            pass

    threading.Thread(target=report, daemon=True).start()


def _stream(made: Tampered, corrupt_after: int | None) -> tuple[str, list[float]]:
    """The streamed text, and when each chunk came; ``corrupt_after`` chunks in, member1 corrupts
    the next row it is sent."""
    stream = made.mesh.client(timeout=30).chat.completions.create(
        model="default",
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": QUESTION}],
    )
    text, times = "", []
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        times.append(time.monotonic())
        if corrupt_after is not None and len(times) == corrupt_after:
            made.corrupt_next.set()
    return text, times


def test_a_frame_a_stage_refuses_fails_the_attempt_at_once_and_the_request_replays(
    tampered: Tampered,
) -> None:
    """member1's own stage refuses the corrupted row (out of step with its record) and reports
    it: the coordinator ends the attempt and the request replays on the route at once, from where
    it was, its text what it would have been; it does not wait for the client's timeout."""
    calm, _ = _stream(tampered, None)
    text, times = _stream(tampered, 3)
    assert tampered.refused_at, "member1 was sent no row to corrupt"
    refused = tampered.refused_at[0]
    after = [t for t in times if t > refused]
    assert after and after[0] - refused <= REPLAYED_WITHIN_S, (refused, times)
    assert text == calm
    events = [e["message"] for e in tampered.mesh.status()["events"]]
    assert any("replaying it" in m for m in events), events[-10:]


def test_a_member_that_keeps_saying_its_stage_failed_is_backed_off(tampered: Tampered) -> None:
    """It is taken for lost, rejoins at once, and waits out a back-off before it is planned again
    (one line says when): over the window it is lost at most twice and planned back in at most
    once, and every request is answered meanwhile by the member that serves."""
    before = max((e["seq"] for e in tampered.mesh.status()["events"]), default=0)
    tampered.flapping.set()
    answers: list[str] = []
    errors: list[str] = []
    stop = threading.Event()

    def load() -> None:
        client = tampered.mesh.client(timeout=60)
        while not stop.is_set():
            try:
                reply = client.chat.completions.create(
                    model="default",
                    max_tokens=8,
                    temperature=0,
                    messages=[{"role": "user", "content": QUESTION}],
                )
                answers.append(reply.choices[0].message.content or "")
            except Exception as exc:  # counted: none may fail
                errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.3)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    events: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + 30
        while not tampered.flapped and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tampered.flapped, "member1 was sent no request to fail"
        while time.monotonic() < tampered.flapped[0] + FLAP_WINDOW_S:
            now = tampered.mesh.status()["events"]
            events.update({e["seq"]: e for e in now if e["seq"] > before})
            time.sleep(0.5)
    finally:
        tampered.flapping.clear()
        stop.set()
        loader.join(90)
    said = [events[seq] for seq in sorted(events)]
    lost = [e for e in said if e["kind"] == "node_lost" and f"node {MEMBER} " in e["message"]]
    back_in = [e for e in said if e["kind"] == "plan_chosen" and MEMBER in e["message"]]
    assert 1 <= len(lost) <= 2 and len(back_in) <= 1, [e["message"] for e in said][-20:]
    assert not errors and answers, (errors, len(answers))
    log = "".join(tampered.mesh.output)
    assert re.search(rf"node {MEMBER} failed .* it is planned again in \d+ s", log), log[-3000:]
