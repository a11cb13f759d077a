"""A start-up that fails is tried again, with a pause that grows, until it succeeds: a node whose
disk is too full for its layers fails its load; once room is made, the mesh serves without
anyone restarting anything. The node's cache is an 8 MiB tmpfs, grown to 2 GiB later."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from seamline.app import LocalModel
from seamline.params import SamplingParams
from tests.support.heal import wait_until
from tests.support.mesh import QUESTION, ask
from tests.support.mesh_harness import MeshProcesses
from tests.support.small_disk import grow, small_file_system

CONTEXT = 1024


@pytest.fixture
def small_cache(tmp_path: Path) -> Iterator[Path]:
    with small_file_system(tmp_path / "node0") as folder:  # the harness's cache of node0
        yield folder


def test_a_start_up_failed_for_want_of_disk_is_retried_and_heals_once_there_is_room(
    small_cache: Path,
) -> None:
    mesh = MeshProcesses(small_cache.parent, nodes=1, serve_args=("--context", str(CONTEXT)))
    try:
        mesh.start()
        failed = lambda: [
            line for line in mesh.output if "start-up failed" in line and "planning again" in line
        ]  # noqa: E731
        wait_until(lambda: len(failed()) >= 2, "the start-up to fail and be tried again")
        assert "free some space" in failed()[0], failed()
        grow(small_cache, "2g")
        mesh.wait_ready()
        local = LocalModel.load(context=CONTEXT)
        ids = local.codec.encode_chat([{"role": "user", "content": QUESTION}])
        expected = local.codec.decode(
            list(local.engine.generate(ids, SamplingParams(max_tokens=12, temperature=0)))
        )
        assert ask(mesh, QUESTION, 12)["choices"][0]["message"]["content"] == expected
    finally:
        mesh.stop()
