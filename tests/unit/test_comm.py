"""Comm transports in real processes (forkserver): sums, gathers, desync, refusal, dead peers, order."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from seamline.net.link import free_port, listen, listen_on_free_port, reserve_port
from seamline.parallel import CommError, DesyncError, GateTag, SingleComm, make_comm
from seamline.parallel.tcp_comm import (
    GATE,
    GATE_MAGIC,
    HELLO,
    HELLO_MAGIC,
    VERSION,
    TcpComm,
)

# Fresh processes forked from a server that has imported torch once (saves ~3 s per rank
# over "spawn"); no parent state or threads are inherited.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(
    ["torch", "seamline.parallel.tcp_comm", "seamline.parallel.torch_comm", __name__]
)
LAYERS = 3
BIG = 1 << 18  # 1 MB of float32: above INLINE_SEND_MAX, the threaded-send path


def partial(rank: int, layer: int, gate: int, numel: int = 256) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * layer + gate)
    return torch.randn(4, numel // 4, generator=gen)  # [tokens, hidden]


def scenario_sum(rank: int, world: int, addresses: list, transport: str) -> dict[str, Any]:
    comm = make_comm(transport, rank, world, addresses, 10.0, "model-abc|f32|2 gates")
    out: dict[str, Any] = {}
    for layer in range(LAYERS):
        for gate in range(2):
            summed = comm.all_reduce(partial(rank, layer, gate), GateTag(layer, gate, 7))
            out[f"{layer}.{gate}"] = summed.numpy().tobytes()
    out["bf16"] = (
        comm.all_reduce(torch.full((8,), float(rank + 1), dtype=torch.bfloat16), GateTag(9, 0, 1))
        .float()
        .tolist()
    )
    out["big"] = comm.all_reduce(partial(rank, 99, 0, BIG), GateTag(99, 0, 1)).numpy().tobytes()
    rows = torch.full(
        (2, rank + 1), float(rank)
    )  # uneven vocabulary slices: [tokens, rows of rank]
    out["gather"] = comm.all_gather(rows, dim=1).tolist()
    comm.close()
    return out


def scenario_light(rank: int, world: int, addresses: list) -> dict[str, Any]:
    comm = TcpComm.connect(rank, world, addresses, 10.0, "fp")
    out = comm.all_reduce(partial(rank, 0, 1), GateTag(0, 1, 1)).numpy().tobytes()
    comm.close()
    return {"0.1": out}


def scenario_desync(rank: int, world: int, addresses: list, transport: str) -> dict[str, Any]:
    comm = make_comm(transport, rank, world, addresses, 5.0, "fp")
    comm.all_reduce(torch.ones(16), GateTag(2, 1, 16))
    comm.all_reduce(torch.ones(16), GateTag(3, rank, 17))  # rank 0 is one gate behind rank 1
    return {}


def scenario_fingerprint(rank: int, world: int, addresses: list, transport: str) -> dict[str, Any]:
    make_comm(transport, rank, world, addresses, 5.0, f"model-{rank}")
    return {}


def scenario_dead_peer(
    rank: int, world: int, addresses: list, mode: str, events: Any
) -> dict[str, Any]:
    comm = TcpComm.connect(rank, world, addresses, 3.0, "fp")
    comm.all_reduce(torch.ones(16), GateTag(0, 0, 1))
    if rank == 1:
        events.put("ready")
        time.sleep(30)  # silent; killed by the test in "kill" mode
    time.sleep(0.3)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(16), GateTag(0, 1, 1))
    except CommError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None}


def _rank_main(
    scenario: str, rank: int, world: int, addresses: list, kwargs: dict, results: Any
) -> None:
    try:
        results.put((rank, "ok", globals()[scenario](rank, world, addresses, **kwargs)))
    except BaseException as exc:  # report every failure to the test, with its class
        results.put((rank, type(exc).__name__, str(exc)))


def run_group(
    scenario: str,
    world: int,
    kwargs: dict | None = None,
    order: list[int] | None = None,
    delay: float = 0.0,
    deadline_s: float = 20.0,
    on_event=None,
) -> dict[int, tuple]:
    """Run ``scenario`` on ``world`` spawned ranks; rank -> (rank, status, payload)."""
    addresses = [("127.0.0.1", free_port()) for _ in range(world)]
    results, procs = CTX.Queue(), {}
    try:
        for i, rank in enumerate(order or range(world)):
            if i and delay:
                time.sleep(delay)
            procs[rank] = CTX.Process(
                target=_rank_main, args=(scenario, rank, world, addresses, kwargs or {}, results)
            )
            procs[rank].start()
        if on_event:
            on_event(procs)
        got: dict[int, tuple] = {}
        end = time.monotonic() + deadline_s
        while len(got) < len(procs) - (1 if on_event else 0):
            try:
                item = results.get(timeout=max(0.1, end - time.monotonic()))
            except queue_mod.Empty:
                raise AssertionError(
                    f"{scenario}: ranks {sorted(set(procs) - set(got))} hung"
                ) from None
            got[item[0]] = item
        return got
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def expected_sums() -> dict[str, bytes]:
    def total(world: int, layer: int, gate: int, numel: int = 256) -> torch.Tensor:
        acc = partial(0, layer, gate, numel).clone()
        for rank in range(1, world):  # rank order, like every rank does
            acc += partial(rank, layer, gate, numel)
        return acc

    return total  # type: ignore[return-value]


@pytest.mark.parametrize("world", [2, 4])
def test_tcp_all_reduce_and_gather(world: int) -> None:
    got = run_group("scenario_sum", world, {"transport": "tcp"})
    total = expected_sums()
    outs = [
        got[r][2] if got[r][1] == "ok" else pytest.fail(f"rank {r}: {got[r]}") for r in range(world)
    ]
    for layer in range(LAYERS):
        for gate in range(2):
            want = total(world, layer, gate).numpy().tobytes()
            assert all(out[f"{layer}.{gate}"] == want for out in outs), (
                f"gate {layer}.{gate} not bit-identical"
            )
    assert all(out["big"] == total(world, 99, 0, BIG).numpy().tobytes() for out in outs)
    assert all(out["bf16"] == [float(world * (world + 1) // 2)] * 8 for out in outs)
    want_gather = [[float(r) for r in range(world) for _ in range(r + 1)]] * 2
    assert all(out["gather"] == want_gather for out in outs)


def test_torch_gloo_all_reduce_and_gather() -> None:
    got = run_group("scenario_sum", 2, {"transport": "torch"})
    total = expected_sums()
    for rank in range(2):
        assert got[rank][1] == "ok", got[rank]
        out = got[rank][2]
        for layer in range(LAYERS):
            for gate in range(2):
                summed = torch.frombuffer(
                    bytearray(out[f"{layer}.{gate}"]), dtype=torch.float32
                ).view(4, -1)
                torch.testing.assert_close(summed, total(2, layer, gate), rtol=1e-6, atol=1e-6)
        assert out["gather"] == [[0.0, 1.0, 1.0]] * 2
        assert out["bf16"] == [3.0] * 8
    assert got[0][2]["0.0"] == got[1][2]["0.0"]


@pytest.mark.parametrize("transport", ["tcp", "torch"])
def test_tag_mismatch_raises_desync_on_both_ranks(transport: str) -> None:
    got = run_group("scenario_desync", 2, {"transport": transport}, deadline_s=15)
    assert got[1][1] == "DesyncError", got[1]
    assert (
        "rank 1 expected reduce gate (3,1,#17), got reduce gate (3,0,#17) from rank 0" in got[1][2]
    )
    assert got[0][1] in ("DesyncError", "CommError"), got[
        0
    ]  # either its own check or the closed link


def test_fingerprint_mismatch_is_refused() -> None:
    got = run_group("scenario_fingerprint", 2, {"transport": "tcp"})
    for rank in range(2):
        assert got[rank][1] == "CommError", got[rank]
        mine, theirs = f"model-{rank}", f"model-{1 - rank}"
        assert (
            f"group mismatch: rank {rank} has {mine} here, {theirs} on rank {1 - rank}"
            in got[rank][2]
        ), got[rank]


def test_killed_peer_raises_comm_error_within_timeout() -> None:
    events = CTX.Queue()

    def kill_when_ready(procs: dict) -> None:
        assert events.get(timeout=15) == "ready"
        os.kill(procs[1].pid, 9)

    got = run_group(
        "scenario_dead_peer", 2, {"mode": "kill", "events": events}, on_event=kill_when_ready
    )
    assert got[0][1] == "ok", got[0]
    assert got[0][2]["error"] == "rank 1 closed the link" or "closed the link" in got[0][2]["error"]
    assert got[0][2]["elapsed"] < 3.0


def test_silent_peer_raises_comm_error_at_timeout() -> None:
    events = CTX.Queue()
    got = run_group(
        "scenario_dead_peer",
        2,
        {"mode": "silent", "events": events},
        on_event=lambda procs: events.get(timeout=15),
    )
    assert got[0][1] == "ok", got[0]
    assert got[0][2]["error"] == "rank 1 sent nothing for gate (0,1,#1) within 3.0 s"
    assert 2.5 < got[0][2]["elapsed"] < 5.0


@pytest.mark.parametrize("order", [[1, 0], [2, 1, 0]])
def test_ranks_connect_in_any_start_order(order: list[int]) -> None:
    got = run_group("scenario_light", len(order), order=order, delay=0.7)
    assert all(got[r][1] == "ok" for r in order), got
    assert {got[r][2]["0.1"] for r in order} == {
        expected_sums()(len(order), 0, 1).numpy().tobytes()
    }


def test_single_comm_returns_its_input() -> None:
    comm = make_comm("auto", 0, 1, [("127.0.0.1", 1)], 1.0, "fp")
    assert isinstance(comm, SingleComm)
    x = torch.randn(3, 5)
    assert comm.all_reduce(x, GateTag(0, 0, 0)) is x and comm.all_gather(x, 1) is x
    comm.close()


def test_bad_headers_are_refused_before_the_payload() -> None:
    ours, theirs = socket.socketpair()
    comm = TcpComm(0, 2, {1: ours}, 2.0)
    # a peer claiming 2^40 elements for a 16-element gate: refused from the header alone
    theirs.sendall(GATE.pack(GATE_MAGIC, VERSION, 1, 0, 5, 9, 1, 1 << 40))
    with pytest.raises(DesyncError, match="sent 1099511627776 elements for gate"):
        comm.all_reduce(torch.ones(16), GateTag(5, 0, 9))
    with pytest.raises(CommError, match="broken since"):
        comm.all_reduce(torch.ones(16), GateTag(5, 1, 9))
    ours2, theirs2 = socket.socketpair()
    theirs2.sendall(b"GARBAGE!" * 4)
    with pytest.raises(CommError, match="non-gate message"):
        TcpComm(0, 2, {1: ours2}, 2.0).all_reduce(torch.ones(16), GateTag(5, 0, 9))
    theirs.close()
    theirs2.close()


def test_another_protocol_version_is_refused_at_hello() -> None:
    """A peer speaking another comm protocol (e.g. the static shared-expert split of version 1)
    is refused at HELLO, naming both versions."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def old_rank_1() -> None:
        sock, _ = server.accept()
        with sock:
            sock.recv(HELLO.size + 64)
            sock.sendall(HELLO.pack(HELLO_MAGIC, VERSION - 1, 1, 2, 2) + b"fp")
            try:
                sock.recv(1)  # until rank 0 hangs up (it may reset the link)
            except OSError:
                pass

    peer = threading.Thread(target=old_rank_1, daemon=True)
    peer.start()
    refusal = f"protocol version mismatch: rank 0 speaks {VERSION}, rank 1 speaks {VERSION - 1}"
    with pytest.raises(CommError, match=refusal):
        TcpComm.connect(
            0,
            2,
            [("127.0.0.1", free_port()), ("127.0.0.1", port)],
            2.0,
            "fp",
            connect_timeout_s=5.0,
        )
    peer.join(5)
    server.close()


def test_strangers_at_a_comm_port_are_dropped_and_the_group_still_forms() -> None:
    """Garbage, a connection closed at once and one silent past the timeout reach rank 1's port
    before rank 0 dials: each is dropped, and the group forms and sums."""
    addresses = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    formed: dict[int, Any] = {}

    def rank_1() -> None:
        try:
            formed[1] = TcpComm.connect(1, 2, addresses, 1.0, "fp", connect_timeout_s=20.0)
        except CommError as exc:
            formed[1] = exc

    thread = threading.Thread(target=rank_1)
    thread.start()
    strangers = [_dial_when_listening(addresses[1]) for _ in range(3)]
    strangers[0].sendall(b"GARBAGE!" * 8)
    strangers[1].close()
    time.sleep(0.2)
    comm0 = TcpComm.connect(0, 2, addresses, 5.0, "fp", connect_timeout_s=20.0)
    thread.join(20)
    assert isinstance(formed[1], TcpComm), formed
    results: dict[int, torch.Tensor] = {}
    reducer = threading.Thread(
        target=lambda: results.update({1: formed[1].all_reduce(torch.ones(4), GateTag(0, 0, 1))})
    )
    reducer.start()
    results[0] = comm0.all_reduce(torch.full((4,), 2.0), GateTag(0, 0, 1))
    reducer.join(10)
    assert torch.equal(results[0], torch.full((4,), 3.0)) and torch.equal(results[1], results[0])
    for sock in strangers:
        sock.close()
    comm0.close()
    formed[1].close()


def _dial_when_listening(address: tuple[str, int], within_s: float = 10.0) -> socket.socket:
    deadline = time.monotonic() + within_s
    while True:
        try:
            return socket.create_connection(address, timeout=1.0)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_free_ports_taken_together_are_distinct() -> None:
    # a group's ports come from separate free_port calls: a port handed out twice would make a
    # rank dial the leader's own listener and wait on a HELLO that never comes
    # half a 64-port window below the ephemeral range (where a machine's own connections may hold a
    # port): picked at random without that memory, 32 draws from 64 would almost surely repeat one
    ports = [free_port(low=16000, high=16064) for _ in range(32)]
    assert len(set(ports)) == 32 and all(16000 <= port < 16064 for port in ports)


def test_a_reserved_port_is_free_to_no_other_process_and_listened_on_again_and_again() -> None:
    # a node draws its comm port at join and listens on it only while a group forms: another
    # process that drew the same port and kept it (a fragment server) would refuse every group
    with reserve_port() as reserved:
        port = reserved.getsockname()[1]
        draw = f"from seamline.net.link import free_port; free_port(low={port}, high={port + 1})"
        other = subprocess.run(
            [sys.executable, "-c", draw], capture_output=True, text=True, timeout=60
        )
        assert other.returncode != 0 and f"no free port in {port}-{port + 1}" in other.stderr, (
            other.stderr
        )
        for _ in range(2):  # a group formed, and formed again
            with (
                listen("127.0.0.1", port) as server,
                socket.create_connection(("127.0.0.1", port)) as dialed,
            ):
                accepted, _ = server.accept()
                dialed.sendall(b"hello")
                assert accepted.recv(5) == b"hello"
                accepted.close()


def test_a_port_announced_before_it_is_served_is_listened_on_from_the_start() -> None:
    # a node names its fragment server's port in its join and serves it after the welcome: drawn
    # and left unbound meanwhile, another process could take it and members could not fetch
    with listen_on_free_port() as listener:
        port = listener.getsockname()[1]
        assert 20000 <= port < 30000  # free_port's range: outside the ephemeral ports
        draw = f"from seamline.net.link import free_port; free_port(low={port}, high={port + 1})"
        other = subprocess.run(
            [sys.executable, "-c", draw], capture_output=True, text=True, timeout=60
        )
        assert other.returncode != 0 and f"no free port in {port}-{port + 1}" in other.stderr, (
            other.stderr
        )
        with socket.create_connection(
            ("127.0.0.1", port)
        ) as dialed:  # queued until the server accepts
            accepted, _ = listener.accept()
            dialed.sendall(b"fetch")
            assert accepted.recv(5) == b"fetch"
            accepted.close()
