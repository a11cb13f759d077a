"""A coordinator killed and started again with its state directory takes its nodes back: they
rejoin on their own under the certificates they hold (no new invite), keep the layers they
had loaded, download nothing, and the mesh answers as before. Started again with another
model, it has its nodes load that one: the old layers they hold are not kept."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from seamline.app import LocalModel
from seamline.mesh.identity import MeshAuthority
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import Challenge, Join, Refuse, Rejoin, Resources
from seamline.params import SamplingParams
from seamline.server.demo import memory_cap_gb
from tests.support.mesh import QUESTION, ask
from tests.support.mesh_harness import MeshProcesses
from tests.support.moe_folder import CONTEXT as MOE_CONTEXT
from tests.support.moe_folder import build_moe_folder
from tests.support.tls_peers import member, tls_link

CONTEXT = 1024


def test_a_restarted_coordinator_takes_its_nodes_back_without_invites_or_downloads(
    tmp_path: Path,
) -> None:
    mesh = MeshProcesses(
        tmp_path,
        nodes=2,
        node_memory_gb=memory_cap_gb(None, 2, CONTEXT),
        serve_args=("--context", str(CONTEXT)),
    )
    try:
        mesh.start()
        mesh.wait_ready()
        before = ask(mesh, QUESTION, 16)["choices"][0]["message"]["content"]
        assert mesh.serve is not None
        mesh.serve.send_signal(signal.SIGKILL)
        mesh.serve.wait()
        time.sleep(1.0)
        mesh.output.clear()
        mesh.start(join=False)  # the same ports and state directory
        status = mesh.wait_ready(timeout=120)
        assert sorted(n["node_id"] for n in status["nodes"]) == ["node0", "node1"], status
        assert [n["bytes_downloaded"] for n in status["nodes"]] == [0, 0], status
        assert all(proc.poll() is None for proc in mesh.node_procs)  # the same node processes
        rejoined = [line for line in mesh.output if "rejoined from" in line]
        assert len(rejoined) == 2, rejoined
        # kept because they hold it, whatever the speeds measured again would plan
        assert any("keep the stages they hold" in line for line in mesh.output), mesh.output
        assert ask(mesh, QUESTION, 16)["choices"][0]["message"]["content"] == before
        _an_impostor_cannot_rejoin(mesh)
        _restarted_with_other_weights(mesh, tmp_path / "moe")
    finally:
        mesh.stop()


def _restarted_with_other_weights(mesh: MeshProcesses, folder: Path) -> None:
    """The coordinator comes back serving another model: the nodes rejoin holding the old one's
    layers, which are not kept; the node planned downloads the new weights and answers as they do."""
    assert mesh.serve is not None
    mesh.serve.send_signal(signal.SIGKILL)
    mesh.serve.wait()
    mesh.model, mesh.serve_args = str(build_moe_folder(folder)), ("--context", str(MOE_CONTEXT))
    mesh.output.clear()
    mesh.start(join=False)
    status = mesh.wait_ready(timeout=120)
    planned = [s["node_id"] for s in status["stages"]]
    downloaded = {n["node_id"]: n["bytes_downloaded"] for n in status["nodes"]}
    assert planned and all(downloaded[node] > 0 for node in planned), status
    local = LocalModel.load(folder, context=MOE_CONTEXT)
    ids = local.codec.encode_chat([{"role": "user", "content": QUESTION}])
    expected = local.codec.decode(
        list(local.engine.generate(ids, SamplingParams(max_tokens=16, temperature=0)))
    )
    assert ask(mesh, QUESTION, 16)["choices"][0]["message"]["content"] == expected


def _an_impostor_cannot_rejoin(mesh: MeshProcesses) -> None:
    """Rejoining takes a certificate naming the node from this mesh's CA: another CA's (the TLS
    handshake fails), or a member's certificate rejoining as another node, is refused."""
    join = Join(
        node_id="node9",
        proof="",
        protocol_version=1,
        resources=Resources(free_memory_bytes=1 << 30, bytes_per_second=1e9),
        data_host="127.0.0.1",
        data_port=9,
    )
    with Link.connect(
        "127.0.0.1", mesh.control_port, tls=member(mesh.root, "node8").client_context()
    ) as link:
        assert isinstance(link.recv(deadline_s=10), Challenge)
        link.send_message(Rejoin(join=join))
        answer = link.recv(deadline_s=10)
        assert isinstance(answer, Refuse) and "rejoined as node node9" in answer.reason, answer
    with pytest.raises(LinkClosed):
        with tls_link(
            ("127.0.0.1", mesh.control_port),
            MeshAuthority.create().identity("node9"),
            trusting=True,
        ) as link:
            assert isinstance(
                link.recv(deadline_s=10), Challenge
            )  # TLS 1.3: refused on the first read
            link.send_message(Rejoin(join=join))
            link.recv(deadline_s=10)
    assert "node9" not in [n["node_id"] for n in mesh.status()["nodes"]]
