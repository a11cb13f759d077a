"""The ports of a process share one pool of unproved connections: floods at two ports are held
to their ports' shares, and a connection at a third port, the pool full, is still taken, the
fullest port's oldest cut for it."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from seamline.net import admission
from seamline.net.admission import Admission, descriptor_shares


@pytest.fixture()
def small_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(admission._POOL, "bound", admission._POOL.bound)  # restored after
    monkeypatch.setattr(admission, "descriptor_shares", lambda: admission.Shares(32, 24, 8))
    yield


def _connection(made: list[socket.socket]) -> socket.socket:
    ours, theirs = socket.socketpair()
    made += [ours, theirs]
    return ours


def test_a_flood_at_one_port_leaves_room_at_another(small_pool: None) -> None:
    made: list[socket.socket] = []
    ports = [Admission(name, 60.0, per_host=100, total=100) for name in ("a", "b", "c")]
    try:
        assert ports[0].total == 8 and ports[0].per_host == 8  # a port's share
        floods = [
            [port.admit(_connection(made), f"10.0.0.{i % 3}") for i in range(40)]
            for port in ports[:2]
        ]
        assert [sum(p.counted for p in flood) for flood in floods] == [8, 8]  # the pool's 16
        member = ports[2].admit(_connection(made), "10.0.0.9")
        assert member.counted and sum(p.counted for f in floods for p in f) == 15
        member.proved()
        assert not member.counted
    finally:
        for port in ports:
            port.close()
        for sock in made:
            sock.close()


def test_shares_keep_a_quarter_of_the_descriptors() -> None:
    shares = descriptor_shares()
    assert shares.unproved == shares.limit - shares.limit // 4
    assert shares.per_port == max(16, shares.unproved // 3)
    assert shares.pool + shares.per_port <= max(shares.unproved, 2 * shares.per_port)
