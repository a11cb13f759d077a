"""Stage 0's batching policy in one process: returned tokens of many sequences run as shared
batches, at most 1/S of the open sequences each, so that an S-stage pipeline keeps S
micro-batches in flight. (The split itself is tested over real sockets in test_mesh.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from seamline.runtime.stage_worker import StageWorker
from seamline.model.ownership import Ownership
from seamline.net.frames import EMPTY_HASH, Row, TokenFrame, TokenRow, prefix_hash
from seamline.net.messages import Open, Prompt, SamplingSpec
from seamline.weights.loader import load_stage, open_source
from tests.reference import save_random_model
from tests.test_dense_models import _configs as dense_configs

SEQUENCES = 6


def _stage0(folder: Path) -> StageWorker:
    save_random_model(dense_configs()["llama"], folder)
    stage = load_stage(open_source(folder), Ownership(layers=(0, 2)))
    return StageWorker(stage, is_first=True, is_last=False)


def _wait_for(frames: list[tuple[list[Row], torch.Tensor]], count: int) -> None:
    deadline = time.monotonic() + 30
    while len(frames) < count:
        assert time.monotonic() < deadline, f"{len(frames)} frames sent, expected {count}"
        time.sleep(0.01)


def test_returned_tokens_run_as_micro_batches_of_one_over_s(tmp_path: Path) -> None:
    worker = _stage0(tmp_path)
    worker.micro_batches = 3  # a 3-stage pipeline
    frames: list[tuple[list[Row], torch.Tensor]] = []
    worker.links.downstream = lambda rows, hidden: frames.append((list(rows), hidden.clone()))
    prompts = [[5 + r, 9, 11 + 2 * r] for r in range(SEQUENCES)]
    for request, prompt in enumerate(prompts):
        worker.open(Open(request=request, sampling=SamplingSpec(max_tokens=8), prompt_len=3, context_length=64))
        worker.prompt(Prompt(request=request, tokens=tuple(prompt)))
    assert [len(rows) for rows, _ in frames] == [1] * SEQUENCES  # each prompt is its own frame
    returned = []
    for request, prompt in enumerate(prompts):
        before = prefix_hash(EMPTY_HASH, prompt)
        returned.append(TokenRow(request, len(prompt), 40 + request, before, prefix_hash(before, [40 + request])))
    worker.tokens(TokenFrame(tuple(returned)))
    _wait_for(frames, SEQUENCES + 3)
    batches = frames[SEQUENCES:]
    assert [len(rows) for rows, _ in batches] == [2, 2, 2]  # 6 open sequences over 3 stages
    assert sorted(row.request for rows, _ in batches for row in rows) == list(range(SEQUENCES))
    for rows, hidden in batches:  # each batched row equals that sequence's step alone
        for i, row in enumerate(rows):
            alone = worker.stage(torch.tensor(prompts[row.request] + [40 + row.request]), 0, worker.stage.new_cache())
            torch.testing.assert_close(hidden[i], alone[-1], atol=1e-5, rtol=0)
