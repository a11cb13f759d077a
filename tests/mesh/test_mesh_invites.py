"""Invites and members, through the real CLI against a real mesh: single-use and revoked
invites, forged tokens and replayed joins are refused; an invite is no administrator's key;
`seamline node remove` ejects a member for good."""

from __future__ import annotations

import dataclasses
import os
import secrets
import ssl
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from seamline.mesh.identity import new_key, signing_request
from seamline.mesh.protocol.invite import Invite, proof
from seamline.net.messages import (
    PROTOCOL_VERSION,
    Attach,
    Challenge,
    Join,
    Refuse,
    Resources,
)
from tests.support.mesh import assert_join_refused
from tests.support.mesh_harness import MeshProcesses, seamline_cmd
from tests.support.tls_peers import member, mesh_authority, tls_link


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    mesh = MeshProcesses(
        tmp_path_factory.mktemp("invites"), nodes=1, serve_args=("--context", "512")
    )
    mesh.start(join=False)
    try:
        yield mesh
    finally:
        mesh.stop()


def admin(mesh: MeshProcesses, *args: str) -> subprocess.CompletedProcess[str]:
    """`seamline invite ...` / `seamline node ...` where the coordinator runs (its state directory)."""
    env = {**os.environ, "SEAMLINE_CACHE": str(mesh.root / "coordinator")}
    return subprocess.run(seamline_cmd(*args), env=env, capture_output=True, text=True, timeout=60)


def _wait_nodes(mesh: MeshProcesses, count: int, timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = mesh.status()["nodes"]
        if len(nodes) == count or time.monotonic() > deadline:
            return nodes
        time.sleep(0.2)


def test_a_single_use_invite_admits_one_node_then_is_used_up(mesh: MeshProcesses) -> None:
    made = admin(mesh, "invite", "create", "--uses", "1", "--expires", "10m")
    assert made.returncode == 0, made.stderr
    token = made.stdout.split()[-1]
    assert token.startswith("seamline-")
    mesh.join("node0", token=token)
    mesh.wait_ready()
    assert_join_refused(mesh, token, "used up")
    listing = admin(mesh, "invite", "list")
    line = next(
        row for row in listing.stdout.splitlines() if row.startswith(Invite.decode(token).id)
    )
    assert "used up" in line and " 1 1 " in " ".join(line.split()) + " ", listing.stdout


def test_a_node_named_as_a_member_is_refused_and_the_member_serves_on(mesh: MeshProcesses) -> None:
    """A second `seamline join` under a member's node id (a valid invite): refused, naming the
    id; the member keeps its place and the mesh keeps serving."""
    proc = mesh.join("node0", token=mesh.token)
    _, stderr = proc.communicate(timeout=60)
    assert (
        proc.returncode != 0
        and "a node named node0 has already joined" in stderr
        and "Traceback" not in stderr
    ), stderr
    assert [n["node_id"] for n in mesh.status()["nodes"]] == ["node0"] and mesh.status()["ready"]
    reply = mesh.client().completions.create(
        model="default", prompt="Hello", max_tokens=4, temperature=0
    )
    assert reply.choices[0].text


def test_a_revoked_forged_or_replayed_invite_is_refused(mesh: MeshProcesses) -> None:
    default = Invite.decode(mesh.token)
    forged = dataclasses.replace(default, id=secrets.token_hex(6)).encode()
    assert_join_refused(mesh, forged, "wrong invite token")
    altered = dataclasses.replace(default, secret=secrets.token_hex(16)).encode()
    assert_join_refused(mesh, altered, "wrong invite token")
    _replay_join(mesh, default)
    revoked = admin(mesh, "invite", "revoke", default.id)
    assert revoked.returncode == 0, revoked.stderr
    assert_join_refused(mesh, mesh.token, "revoked")
    assert admin(mesh, "invite", "revoke", "nosuchinvite").returncode != 0


def _replay_join(mesh: MeshProcesses, invite: Invite) -> None:
    """A join recorded for one challenge, sent again on a new connection: refused."""
    address = ("127.0.0.1", mesh.control_port)
    with tls_link(address) as first:
        challenge = first.recv()
        assert isinstance(challenge, Challenge)
        recorded = Join(
            node_id="replayer",
            proof=proof(invite.secret, challenge.nonce),
            invite_id=invite.id,
            protocol_version=PROTOCOL_VERSION,
            resources=Resources(free_memory_bytes=1, bytes_per_second=1),
            data_host="127.0.0.1",
            data_port=1,
            csr=signing_request(new_key(), "replayer"),
        )
    with tls_link(address) as second:
        assert isinstance(second.recv(), Challenge)
        second.send_message(recorded)
        answer = second.recv(deadline_s=10)
        assert isinstance(answer, Refuse) and "wrong invite token" in answer.reason, answer


def test_an_invite_is_no_administrator_and_fetches_no_fragments(mesh: MeshProcesses) -> None:
    """Administration takes the administrator's key only. Fragments are served on their own
    port, over mutual TLS: a client without a member's certificate is refused in the handshake,
    and a member's certificate with the invite's secret instead of its own token gets a 401."""
    secret = Invite.decode(mesh.token).secret
    for headers in (
        {"Authorization": f"Bearer {secret}"},
        {},
        {"Authorization": "Bearer seamline-admin-guess"},
    ):
        reply = httpx.get(f"{mesh.base_url}/api/admin/invites", headers=headers, timeout=10)
        assert reply.status_code == 401, reply.status_code
    assert httpx.get(f"{mesh.base_url}/fragments/manifest.json", timeout=10).status_code == 404
    manifest = f"https://127.0.0.1:{mesh.fragments_port}/fragments/manifest.json"
    anonymous = ssl.create_default_context(cadata=mesh_authority(mesh.root).ca_pem)
    anonymous.check_hostname = False
    with pytest.raises(httpx.HTTPError):
        httpx.get(
            manifest, verify=anonymous, headers={"Authorization": f"Bearer {secret}"}, timeout=10
        )
    as_member = member(mesh.root, "someone").client_context()
    reply = httpx.get(
        manifest, verify=as_member, headers={"Authorization": f"Bearer {secret}"}, timeout=10
    )
    assert reply.status_code == 401
    key = (mesh.root / "coordinator" / "mesh" / "admin.key").read_text().strip()
    assert (mesh.root / "coordinator" / "mesh" / "admin.key").stat().st_mode & 0o077 == 0
    reply = httpx.get(
        f"{mesh.base_url}/api/admin/invites", headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    assert reply.status_code == 200 and all("secret" not in row for row in reply.json()["invites"])


def test_a_removed_node_is_ejected_and_cannot_rejoin(mesh: MeshProcesses) -> None:
    if not mesh.status()["nodes"]:
        test_a_single_use_invite_admits_one_node_then_is_used_up(mesh)
    node = mesh.node_procs[0]
    removed = admin(mesh, "node", "remove", "node0")
    assert removed.returncode == 0, removed.stderr
    assert node.wait(timeout=30) is not None  # its control link dropped: the node stops
    assert _wait_nodes(mesh, 0) == [] and not mesh.status()["ready"]
    fresh = admin(mesh, "invite", "create", "--expires", "5m").stdout.split()[-1]
    again = mesh.join("node0", token=fresh)
    _, stderr = again.communicate(timeout=60)
    assert again.returncode != 0 and "node0 was removed" in stderr, stderr


def test_a_control_link_needs_the_certificate_of_the_node_that_just_enrolled(
    mesh: MeshProcesses,
) -> None:
    """A member's certificate opens a control link only as the node it names, and only right
    after that node enrolled: another node's id, or an id that never enrolled, is refused."""
    address = ("127.0.0.1", mesh.control_port)
    for certified, claimed in (("mallory", "node0"), ("ghost", "ghost")):
        with tls_link(address, member(mesh.root, certified)) as link:
            assert isinstance(link.recv(), Challenge)
            link.send_message(Attach(node_id=claimed))
            answer = link.recv(deadline_s=10)
            assert isinstance(answer, Refuse) and "has not just enrolled" in answer.reason, answer
