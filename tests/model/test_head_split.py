"""Head split (tensor parallel): N ranks' partial attention and feed-forward sum to one model.

N ranks run in one process as threads, each with its own Stage loaded under
``Ownership(shard=(r, N))`` and joined by the project's in-process ``ThreadComm`` (a barrier
and shared slots, summed in rank order). This tests the model math of the split (which rows, columns
and heads each rank owns, and the two gates per layer), not a transport. Every rank runs a
16-token prefill and 8 decode steps concurrently; the ranks' vocab-shard logits are
concatenated and compared with the unsplit Stage within 1e-4 (fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the reference: a test dependency, never skipped

from seamline.config import ModelConfig  # noqa: E402
from seamline.errors import ConfigError  # noqa: E402
from seamline.model.cache import SequenceCache  # noqa: E402
from seamline.model.stage import Stage  # noqa: E402
from seamline.ownership import Ownership, rank_ownership  # noqa: E402
from seamline.parallel.comm import Comm, GateTag  # noqa: E402
from seamline.parallel.thread_comm import ThreadComm, ThreadGroup, run_ranks  # noqa: E402
from seamline.weights.loader import load_stage, open_source  # noqa: E402

ATOL = 1e-4
PREFILL, DECODE = 16, 8
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
DEEPSEEK = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
)
# Parameters every rank holds whole (by target-name suffix); all others are 1/N per rank.
# Shared experts are whole on every rank, which computes the rows each token gives it (model/moe.py).
REPLICATED = (
    "norm.weight",
    "embed",
    "ffn.router",
    "ffn.router_bias",
    "attn.kv_a",
    "attn.q_a",
    "ffn.shared.gate_up",
    "ffn.shared.down",
)


class RecordingComm(ThreadComm):
    """The project's thread comm (``parallel.thread_comm``), keeping the tags of its gates."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        super().__init__(group, rank)
        self.tags: list[GateTag] = []

    def all_reduce(self, tensor: torch.Tensor, tag: GateTag) -> torch.Tensor:
        self.tags.append(tag)
        return super().all_reduce(tensor, tag)


def _randomize(model: torch.nn.Module) -> None:
    """Weights large enough that a wrong slice shows; norms away from one."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.08 * noise)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))


def _configs() -> dict[str, Any]:
    return {
        "llama": transformers.LlamaConfig(**SMALL),
        "qwen2": transformers.Qwen2Config(**SMALL),
        "qwen3": transformers.Qwen3Config(**SMALL, head_dim=32),
        # 6 query heads, 3 KV heads: on 4 ranks the shares are 1, 2, 1, 2 heads, and KV heads
        # 0 and 2 are held by two ranks each (uneven split, explicit KV-head map)
        "llama_uneven": transformers.LlamaConfig(
            **{**SMALL, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}
        ),
        "mixtral": transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
        "deepseek_v3": transformers.DeepseekV3Config(**DEEPSEEK),
    }


def _save(name: str, folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_configs()[name], dtype=torch.float32).eval()
    _randomize(model)
    model.save_pretrained(folder)


def _run(stage: Stage, ids: torch.Tensor) -> tuple[torch.Tensor, SequenceCache]:
    """Prefill ids[:PREFILL], then decode the rest one token at a time. -> logits [T, V_owned]."""
    cache = stage.new_cache()
    rows = [stage(ids[:PREFILL], 0, cache)]
    for pos in range(PREFILL, ids.shape[0]):
        rows.append(stage(ids[pos : pos + 1], pos, cache))
    return torch.cat(rows), cache


def _run_split(folder: Path, world: int, ids: torch.Tensor) -> tuple[list[Stage], list[Any]]:
    """Load N rank Stages and run them concurrently. -> (stages, [(logits, cache, comm)])."""
    source = open_source(folder)
    config = ModelConfig.from_hf_dict(source.config_dict())
    group = ThreadGroup(world)
    comms = [RecordingComm(group, r) for r in range(world)]
    assert all(isinstance(c, Comm) for c in comms)  # the parallel package's protocol
    stages = [
        load_stage(source, rank_ownership(config, r, world), comm=comms[r]) for r in range(world)
    ]
    results = run_ranks(group, [lambda stage=stage: _run(stage, ids) for stage in stages])
    return stages, [(logits, cache, comm) for (logits, cache), comm in zip(results, comms)]


def _check_shares(whole: Stage, rank_stage: Stage, world: int) -> None:
    """Each parameter is either replicated (whole shape) or exactly 1/N of the whole."""
    full = dict(whole.named_parameters())
    config = whole.config
    kv_replicated = not config.is_mla and config.num_kv_heads < world
    for name, p in rank_stage.named_parameters():
        ref = full[name]
        if name.endswith(REPLICATED):
            assert p.shape == ref.shape, name
        elif kv_replicated and name.endswith(("attn.qkv", "attn.qkv_bias")):
            rows = (config.num_heads // world + 2) * config.head_dim  # one KV head per rank
            assert p.shape[0] == rows, (name, tuple(p.shape))
        else:
            assert p.numel() * world == ref.numel(), (name, tuple(p.shape), tuple(ref.shape))


def _check_cache(config: ModelConfig, cache: SequenceCache, world: int) -> None:
    seq = PREFILL + DECODE
    for kv in cache.layers.values():
        assert kv.k is not None and kv.v is not None
        if config.is_mla:  # the latent has no head dim: replicated
            assert kv.k.shape[0] == 1 and kv.k.shape[2] == config.kv_lora_rank
        else:
            assert kv.k.shape[0] == kv.v.shape[0] == max(config.num_kv_heads // world, 1)
        assert kv.k.shape[1] >= seq


CASES = [
    ("llama", 2),
    ("llama", 4),
    ("qwen2", 2),
    ("qwen3", 2),
    ("mixtral", 2),
    ("mixtral", 4),
    ("deepseek_v3", 2),
    ("deepseek_v3", 4),
]


@pytest.mark.parametrize(("name", "world"), CASES)
def test_head_split_equals_whole(tmp_path: Path, name: str, world: int) -> None:
    _save(name, tmp_path)
    whole = load_stage(open_source(tmp_path))
    ids = torch.randint(0, 256, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(1))
    expected, _ = _run(whole, ids)
    stages, results = _run_split(tmp_path, world, ids)
    got = torch.cat([logits for logits, _, _ in results], dim=1)  # vocab shards in rank order
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    assert err < ATOL, f"max |split - whole| = {err:.2e} (logit scale {expected.abs().max():.2f})"
    layers = whole.config.num_layers
    first_tags = [GateTag(i, g, 0) for i in range(layers) for g in (0, 1)]
    for stage, (_, cache, comm) in zip(stages, results):
        _check_shares(whole, stage, world)
        _check_cache(whole.config, cache, world)
        assert comm.tags[: 2 * layers] == first_tags
        assert len(comm.tags) == 2 * layers * (1 + DECODE)


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_head_split_equals_whole(tmp_path: Path, world: int) -> None:
    """Heads that do not divide by N: shares differ by one head; the sum is still the model."""
    _save("llama_uneven", tmp_path)
    whole = load_stage(open_source(tmp_path))
    ids = torch.randint(0, 256, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(3))
    expected, _ = _run(whole, ids)
    stages, results = _run_split(tmp_path, world, ids)
    got = torch.cat([logits for logits, _, _ in results], dim=1)
    err = (got - expected).abs().max().item()
    assert err < ATOL, f"max |split - whole| = {err:.2e}"
    heads = [s.layers["0"].attn.heads for s in stages]  # type: ignore[union-attr]
    assert sum(heads) == 6 and max(heads) - min(heads) <= 1, heads


def test_mla_expanded_path_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill above takes MLA's absorbed path; force the expanded one too."""
    from seamline.model import mla

    monkeypatch.setattr(mla.MLAttention, "_prefer_absorbed", lambda self, count: False)
    _save("deepseek_v3", tmp_path)
    ids = torch.randint(0, 256, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(2))
    expected, _ = _run(load_stage(open_source(tmp_path)), ids)
    _, results = _run_split(tmp_path, 2, ids)
    got = torch.cat([logits for logits, _, _ in results], dim=1)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_head_ranges() -> None:
    own = Ownership(layers=(0, 1), shard=(1, 4))
    assert own.head_range(8) == (2, 4)
    assert own.kv_head_range(8, 4) == (1, 2)  # split evenly
    assert own.kv_head_range(8, 2) == (0, 1)  # 2 KV heads over 4 ranks: replicated pairs
    assert Ownership(layers=(0, 1), shard=(3, 4)).kv_head_range(8, 2) == (1, 2)
    assert own.kv_head_range(8, 1) == (0, 1)  # multi-query: every rank holds the one head
    # uneven shares: 9 heads (3 KV heads) on 2 ranks -> 4 and 5 query heads; KV head 1 serves
    # query heads 3, 4 and 5, which fall on both ranks, so both hold it
    assert Ownership(layers=(0, 1), shard=(0, 2)).head_range(9) == (0, 4)
    assert Ownership(layers=(0, 1), shard=(1, 2)).head_range(9) == (4, 9)
    assert Ownership(layers=(0, 1), shard=(0, 2)).kv_head_range(9, 3) == (0, 2)
    assert Ownership(layers=(0, 1), shard=(1, 2)).kv_head_range(9, 3) == (1, 3)
    assert Ownership(layers=(0, 1), shard=(1, 4)).kv_head_range(12, 6) == (1, 3)  # heads 3..5
    with pytest.raises(ConfigError, match="cannot be shared by 8 ranks"):
        Ownership(layers=(0, 1), shard=(0, 8)).head_range(6)
