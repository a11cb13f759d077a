"""The coordinator checks the speed a joining node claims: over a real link, a node that computes
the probe rightly at its claimed speed is believed, one slower than it claims is planned at no
more than 1.2 times what it proved, and one that answers without computing is not believed at all."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from seamline.mesh.plan.measured import planned_rate
from seamline.mesh.protocol.claims import (
    SpeedCheck,
    block_sums,
    expected_sums,
    probe_matrix,
    rate_of,
)
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import SpeedProbe, SpeedReady, SpeedSums


def _pair() -> tuple[Link, Link]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    return Link(accepted, "node"), Link(client, "coordinator")


def _node(link: Link, delay_s: float = 0.0, honest: bool = True) -> None:
    """A node's side of the probe (as ``Node._speed_probe``), slowed or lying as asked."""
    matrix = None
    try:
        while True:
            probe = link.recv()
            assert isinstance(probe, SpeedProbe)
            if not probe.vector:
                matrix = probe_matrix(probe.seed, probe.rows, probe.cols)
                link.send_message(SpeedReady())
                continue
            assert matrix is not None  # kept for every round, as a node does
            time.sleep(delay_s)
            sums = block_sums(matrix, torch.tensor(probe.vector)) if honest else [0.0] * 64
            link.send_message(SpeedSums(sums=sums))
    except LinkClosed:
        pass


def _check(claimed: float, **node: object) -> float | None:
    coordinator, node_link = _pair()
    check = SpeedCheck(coordinator, claimed, rtt_s=0.0)
    threading.Thread(target=_node, args=(node_link,), kwargs=node, daemon=True).start()

    def read() -> None:
        try:
            while True:
                message = coordinator.recv()
                if isinstance(message, (SpeedReady, SpeedSums)):
                    check.answer(message)
        except LinkClosed:
            pass

    threading.Thread(target=read, daemon=True).start()
    try:
        return check.run()
    finally:
        coordinator.close()
        node_link.close()


def test_an_honest_claim_is_believed_a_false_one_is_measured_a_lie_is_refused() -> None:
    proven = _check(1e9)  # 32 MiB at 1 GB/s is 34 ms: any machine computes it faster
    assert proven is not None and planned_rate(1e9, proven) == 1e9
    slow = _check(1e12, delay_s=0.3)  # claims 1 TB/s, answers each product after 0.3 s
    assert slow is not None and slow < 34 * 2**20 / 0.3 * 1.01, slow
    assert planned_rate(1e12, slow) == pytest.approx(1.2 * slow)
    assert _check(1e9, honest=False) is None


def test_a_node_claiming_ten_times_what_it_proves_is_planned_at_its_proven_rate() -> None:
    """Today's claim within five times of the proof is no longer believed: a tenth is planned at
    1.2 times the proof; a claim below the proof stands."""
    proven = 7.1e9
    assert planned_rate(10 * proven, proven) == pytest.approx(1.2 * proven)
    assert planned_rate(2.2 * proven, proven) == pytest.approx(1.2 * proven)
    assert planned_rate(1.1 * proven, proven) == pytest.approx(1.1 * proven)
    assert planned_rate(0.5 * proven, proven) == 0.5 * proven
    assert planned_rate(10 * proven, proven, served=proven / 2) == proven / 2  # served slower
    assert planned_rate(3e9, None) == 3e9  # not probed yet: planned at nothing but its claim


def test_the_coordinator_checks_block_by_block_what_the_node_computes_whole() -> None:
    """The coordinator never holds the 32 MiB matrix: its per-block sums equal the node's answer."""
    vectors = torch.randn(1024, 3)
    expected = expected_sums(7, vectors)
    matrix = probe_matrix(7)
    for i in range(3):
        assert torch.allclose(
            torch.tensor(block_sums(matrix, vectors[:, i])), expected[i], rtol=1e-4, atol=1e-3
        )
    assert not torch.allclose(
        expected, expected_sums(8, vectors), rtol=1e-2, atol=1
    )  # the seed matters


def test_a_long_round_trip_a_node_made_cannot_make_its_answer_fast() -> None:
    """The link's round trip is taken off the answer's time, never more than half of it."""
    took = 0.01
    assert rate_of(took, 0.002) == pytest.approx(32 * 2**20 / 0.008)
    assert rate_of(took, 0.5) == pytest.approx(2 * 32 * 2**20 / took)  # pongs held back: 2x at most
