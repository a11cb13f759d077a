"""DeepSeek-V4 split by layer range over a 2-node mesh (real processes, real sockets) equals
the single process: the frames between the stages carry the residual [tokens, 4, hidden] and
the tokens' ids, which the second stage's hash-routed layer reads."""

from __future__ import annotations

from pathlib import Path

from seamline.app import LocalModel
from seamline.params import SamplingParams
from tests.support.mesh_harness import split_completion
from tests.support.v4_folder import CONTEXT, PROMPT, build_v4_folder


def test_v4_mesh_of_two_stages_matches_single_process(tmp_path: Path) -> None:
    folder = build_v4_folder(tmp_path / "v4")
    local = LocalModel.load(folder, context=CONTEXT)
    ids = local.codec.encode(PROMPT)
    tokens = list(local.engine.generate(ids, SamplingParams(max_tokens=24)))
    assert (
        len(tokens) == 24 and len(set(tokens)) > 1
    )  # a run long enough to cross windows, not one token
    expected = local.codec.decode(tokens)
    assert split_completion(tmp_path / "mesh", folder, PROMPT, 24, CONTEXT) == expected
