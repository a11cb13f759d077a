"""A random Mixture-of-Experts checkpoint split over a 2-node mesh equals the single process."""

from __future__ import annotations

from pathlib import Path

import pytest

from seamline.app import LocalModel
from seamline.mesh.node.process import Node, NodeOptions
from seamline.mesh.protocol.invite import Invite
from seamline.net.messages import Assign
from seamline.params import SamplingParams
from tests.support.mesh_harness import split_completion
from tests.support.moe_folder import CONTEXT, PROMPT, build_moe_folder


def test_moe_mesh_matches_single_process(tmp_path: Path) -> None:
    folder = build_moe_folder(tmp_path / "moe")
    local = LocalModel.load(folder, context=CONTEXT)
    ids = local.codec.encode(PROMPT)
    expected = local.codec.decode(list(local.engine.generate(ids, SamplingParams(max_tokens=24))))
    assert split_completion(tmp_path / "mesh", folder, PROMPT, 24, CONTEXT) == expected


def test_a_node_refuses_an_assignment_it_cannot_hold() -> None:
    node = Node(Invite(("127.0.0.1",), 1, 2, "s", 0.0), NodeOptions(max_memory_bytes=1 << 30))
    assign = Assign(
        plan_id=1,
        model_hash="h",
        fragments_url="http://x",
        layers=(0, 4),
        owns_embedding=True,
        owns_head=False,
        dtype="float32",
        context_length=512,
        memory_bytes=3 << 30,
    )
    with pytest.raises(
        MemoryError, match=r"cannot hold layers \[0,4\): they need 3.00 GiB, this node has 1.00 GiB"
    ):
        node._check_room(assign)
