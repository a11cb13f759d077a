"""Live growth: a node that joins a serving mesh is planned in when the plan with it is
predicted at least 10% faster; the requests in flight during the switch replay on the new
route and lose nothing. It fetches the layers the others hold from them, not the coordinator.

The first two nodes share core 0 (one thread each), the joining node brings core 1, so the
switch adds compute as a new machine would. The rate before and after is a benchmark's to
measure, not a test's (timed assertions fail on a busy machine); the test checks the
coordinator's predicted gain, which decided the switch."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest

from seamline.server.demo import memory_cap_gb
from tests.support.heal import REQUESTS, stream_request, wait_until
from tests.support.mesh_harness import MeshProcesses

CONTEXT = 1024
CORE = {
    0: ("env", "OMP_NUM_THREADS=1", "taskset", "-c", "0"),
    1: ("env", "OMP_NUM_THREADS=1", "taskset", "-c", "1"),
}


@pytest.fixture
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    mesh = MeshProcesses(
        tmp_path_factory.mktemp("growth"),
        nodes=2,
        node_memory_gb=memory_cap_gb(None, 2, CONTEXT),
        serve_args=("--context", str(CONTEXT)),
    )
    try:
        mesh.start(join=False)
        for node in ("node0", "node1"):
            mesh.join(node, prefix=CORE[0])
        mesh.wait_ready()
        yield mesh
    finally:
        mesh.stop()


def test_a_node_that_joins_under_load_is_planned_in_and_no_request_is_lost(
    mesh: MeshProcesses,
) -> None:
    client = mesh.client(timeout=300)
    before = [stream_request(client, r) for r in REQUESTS]
    answers: list[tuple[int, tuple[str, str]]] = []
    planned_in = threading.Event()

    def keep_asking(i: int) -> None:  # load until the switch is over
        while not planned_in.is_set():
            answers.append((i, stream_request(client, REQUESTS[i])))

    load = [threading.Thread(target=keep_asking, args=(i,)) for i in range(len(REQUESTS))]
    for thread in load:
        thread.start()
    mesh.join("node2", prefix=CORE[1])
    wait_until(
        lambda: (
            "node2" in [s["node_id"] for s in mesh.status()["stages"]] and mesh.status()["ready"]
        ),
        "the joining node to be planned in",
    )
    planned_in.set()
    for thread in load:
        thread.join(timeout=300)
    assert answers and all(
        answer == before[i] for i, answer in answers
    )  # nothing lost in the switch
    assert any(
        "re-planned to take node2 in" in line for line in mesh.output
    )  # requests were in flight
    (gain,) = [
        float(m.group(1))
        for line in mesh.output
        if (m := re.search(r"planning node2 in: predicted ([0-9.]+)x", line))
    ]
    assert gain >= 1.10, gain
    joined = next(n for n in mesh.status()["nodes"] if n["node_id"] == "node2")
    assert 0 < joined["bytes_from_peers"] <= joined["bytes_downloaded"], (
        joined
    )  # layers the others held
