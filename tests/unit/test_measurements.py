"""Link measurements a member cannot forge or use to poison the planner: pongs are taken only for
pings sent (random nonces), a measurement outside physical bounds is refused, and the planner
plans with what is left."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from seamline.mesh.control.peer_links import PeerLinks
from seamline.mesh.plan.types import LinkCost
from seamline.mesh.protocol.link_probe import Pongs, measure, unphysical
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import PeerLink, Ping, Pong


def test_a_pong_is_taken_only_for_a_ping_that_was_sent() -> None:
    pongs = Pongs()
    assert not pongs.arrived(1)  # sent before it was asked: the guessable nonces of old
    pongs.expect(12345)
    assert pongs.arrived(12345)
    assert not pongs.arrived(12345)  # once
    assert pongs.wait(12345, 1.0) is not None


def _linked_pair() -> tuple[Link, Link]:
    a, b = socket.socketpair()
    return Link(a, "coordinator side"), Link(b, "member side")


def test_a_member_that_answers_before_it_is_asked_is_not_measured_faster() -> None:
    """A member that sends pongs for the nonces it guesses, before any ping, and then answers
    the real pings honestly: the early pongs are ignored; the measurement is the link's."""
    ours, theirs = _linked_pair()
    pongs = Pongs()
    for guess in range(1, 6):  # the nonces a counter from 1 would have used
        theirs.send_message(Pong(nonce=guess))

    def reader() -> None:
        with contextlib.suppress(LinkClosed):
            while True:
                message = ours.recv()
                if isinstance(message, Pong):
                    pongs.arrived(message.nonce)

    def member() -> None:
        with contextlib.suppress(LinkClosed):
            while isinstance(ping := theirs.recv(), Ping):
                theirs.send_message(Pong(nonce=ping.nonce))

    for target in (reader, member):
        threading.Thread(target=target, daemon=True).start()
    measured = measure(ours, pongs)
    assert measured is not None and not unphysical(measured)
    ours.close()
    theirs.close()


@pytest.mark.parametrize(
    "link, problem",
    [
        (LinkCost(-0.057e-3, 1e8), "latency"),  # what a forged early pong gave
        (LinkCost(1e-4, 262e9), "bandwidth"),
        (LinkCost(float("nan"), 1e8), "latency"),
        (LinkCost(1e-4, 0.0), "bandwidth"),
        (LinkCost(60.0, 1e8), "latency"),
    ],
)
def test_unphysical_measurements_are_named(link: LinkCost, problem: str) -> None:
    assert problem in unphysical(link)


def test_a_forged_peer_report_is_refused_and_plans_are_still_made() -> None:
    """A member reports a link with negative latency and 262 GB/s: it is refused (the pair is
    planned from the access links) and the planner still plans."""
    from seamline.mesh.plan.planner import plan
    from seamline.mesh.plan.types import ModelSpec, NodeInfo, PlanOptions
    from seamline.mesh.protocol.link_probe import Reach, link_table

    peers = PeerLinks()
    peers.ask("a", "b")
    assert peers.report(
        "a", PeerLink(peer_node="b", latency_s=-0.057e-3, bandwidth_bytes_per_s=262e9)
    )
    assert peers.wait("a", "b", relayed=False, timeout_s=1.0) is None
    assert peers.measured() == {}
    access = LinkCost(2e-4, 1e8)
    links = link_table([Reach("a", True, access), Reach("b", True, access)], peers.measured())
    spec = ModelSpec("m", 8, 64, (1 << 20,) * 8, 1 << 18, 1 << 18, 256, 256)
    nodes = [NodeInfo("a", 1 << 30, 1e9, "a:1"), NodeInfo("b", 1 << 30, 1e9, "b:1")]
    assert plan(spec, nodes, links, PlanOptions(context_tokens=64)).stages
