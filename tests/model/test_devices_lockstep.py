"""A lockstep rank's shard computes on its own device: heads, experts and vocabulary rows
split, the gates' partial sums handed to the group's comm on that device, and nothing else
moving. Checked on the meta device (as tests/model/test_devices.py does for a whole stage),
with a comm that refuses any tensor off it and answers each gate with tensors on it."""

from __future__ import annotations

import torch

from seamline.app import default_model_path
from seamline.config import ModelConfig
from seamline.model.cache import Span
from seamline.ownership import rank_ownership
from seamline.parallel.comm import GATHER_TAG, GateTag
from seamline.runtime.lockstep_group import LockstepRank
from seamline.runtime.lockstep_leader import LockstepGroup
from seamline.weights.loader import load_stage, open_source

META = torch.device("meta")


class DeviceComm:
    """Rank 0 of ``world`` whose gates see only tensors on ``device``: an all_reduce answers with
    the tensor itself, an all_gather with ``world`` copies of it (the peers' shards on the meta
    device have no values to differ by). Counts the gates it passed."""

    rank = 0

    def __init__(self, world: int, device: torch.device) -> None:
        self.world, self.device, self.gates = world, device, 0

    def _on_device(self, tensor: torch.Tensor, tag: GateTag) -> None:
        assert tensor.device == self.device, f"gate {tag} got a tensor on {tensor.device}"
        self.gates += 1

    def all_reduce(self, tensor: torch.Tensor, tag: GateTag) -> torch.Tensor:
        self._on_device(tensor, tag)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int, tag: GateTag = GATHER_TAG) -> torch.Tensor:
        self._on_device(tensor, tag)
        return torch.cat([tensor] * self.world, dim)

    def close(self) -> None:
        pass


def test_a_rank_shard_keeps_its_step_on_its_device() -> None:
    """Rank 0 of 2 of the embedded model (9 query heads: 4 here; the head's vocabulary rows
    halved); a prefill, a decode and a batched step. (An MoE's prefill reads its experts' token
    counts back to the host, once per layer: not checked here.)"""
    source = open_source(default_model_path())
    config = ModelConfig.from_hf_dict(source.config_dict())
    comm = DeviceComm(2, META)
    stage = load_stage(
        source, rank_ownership(config, 0, 2), torch.float32, config, comm=comm, device=META
    )
    assert all(p.device == META for p in stage.parameters())
    shard = stage.ownership.vocab_range(config)
    width = shard[1] - shard[0]
    first, second = stage.new_cache(), stage.new_cache()
    assert tuple(stage.forward(torch.arange(12), 0, first).shape) == (12, width)
    assert comm.gates >= 2 * config.num_layers  # attention's and the feed-forward's gate per layer
    out = stage.forward(torch.tensor([3]), 12, first)
    assert out.device == META and tuple(out.shape) == (1, width)
    out = stage.forward_batch(
        torch.arange(8), [Span(0, 1, 13, first), Span(1, 7, 0, second)], last_only=True
    )
    assert out.device == META and tuple(out.shape) == (2, width)


def test_a_rank_loads_and_serves_on_the_device_it_is_given() -> None:
    """A whole group of one rank placed on the meta device: its stage, the group stage's input
    device, and a prefill's logits (the sampling boundary) come back on it."""
    rank = LockstepRank(default_model_path(), 0, 1, [("127.0.0.1", 0)], device=META)
    group = LockstepGroup(rank)
    try:
        assert all(p.device == META for p in rank.stage.parameters())
        seq = group.create(greedy=False)
        logits = group.run(seq, 0, torch.arange(5))
        assert logits.device == META and tuple(logits.shape) == (rank.config.vocab_size,)
    finally:
        group.close()
