"""What one process owns of a model: a layer range, an expert range, a vocabulary range.

Ranges are half-open ``(start, end)``. ``shard = (rank, world)`` divides a lockstep group's
work: the rows of dense feed-forwards (shared experts' rows are divided per token, see
model/moe.py), and the attention heads. Rank r owns query heads ``[r*H/N, (r+1)*H/N)``
and the KV heads those use: an even share when ``Hkv`` divides by N, else (N divisible by
``Hkv``) the one KV head its query heads share, replicated on N/Hkv ranks. With
``world == 1`` (the default) everything is owned. With everything owned, a Stage is the
whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

from seamline.config import ModelConfig
from seamline.errors import ConfigError

Range = tuple[int, int]


@dataclass(frozen=True)
class Ownership:
    layers: Range
    experts: Range | None = None  # None: every routed expert
    vocab: Range | None = None  # None: the whole vocabulary (output head rows)
    shard: tuple[int, int] = (0, 1)  # (rank, world) for feed-forward rows

    @classmethod
    def full(cls, config: ModelConfig) -> Ownership:
        return cls(layers=(0, config.num_layers))

    def owns_embedding(self) -> bool:
        return self.layers[0] == 0

    def owns_head(self, config: ModelConfig) -> bool:
        return self.layers[1] == config.num_layers

    def layer_indices(self) -> range:
        return range(*self.layers)

    def expert_range(self, config: ModelConfig) -> Range:
        return self.experts if self.experts is not None else (0, config.num_experts)

    def vocab_range(self, config: ModelConfig) -> Range:
        return self.vocab if self.vocab is not None else (0, config.vocab_size)

    def shard_rows(self, rows: int) -> Range:
        """The slice of ``rows`` feed-forward rows this shard owns (even split)."""
        rank, world = self.shard
        if rows % world:
            raise ConfigError(f"{rows} feed-forward rows do not divide among {world} ranks")
        per = rows // world
        return (rank * per, (rank + 1) * per)

    def head_range(self, heads: int) -> Range:
        """The query (or MLA) heads this shard owns: ``[r*H//N, (r+1)*H//N)`` — an even split
        when N divides H, else shares differing by one head (9 heads on 2 ranks: 4 and 5)."""
        rank, world = self.shard
        if world > heads:
            raise ConfigError(f"{heads} attention heads cannot be shared by {world} ranks")
        return (rank * heads // world, (rank + 1) * heads // world)

    def kv_head_range(self, heads: int, kv_heads: int) -> Range:
        """The KV heads this shard's query heads read (grouped-query attention); a KV head
        whose query heads fall on several ranks is held by each of them."""
        if heads % kv_heads:
            raise ConfigError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        q0, q1 = self.head_range(heads)
        group = heads // kv_heads  # query heads per KV head
        return (q0 // group, -(-q1 // group))

    def validate(self, config: ModelConfig) -> None:
        start, end = self.layers
        if not 0 <= start < end <= config.num_layers:
            raise ConfigError(f"layer range [{start},{end}) is not inside [0,{config.num_layers})")
        e0, e1 = self.expert_range(config)
        if not 0 <= e0 <= e1 <= config.num_experts:
            raise ConfigError(f"expert range [{e0},{e1}) is not inside [0,{config.num_experts})")
        v0, v1 = self.vocab_range(config)
        if not 0 <= v0 < v1 <= config.vocab_size:
            raise ConfigError(f"vocab range [{v0},{v1}) is not inside [0,{config.vocab_size})")


def rank_ownership(
    config: ModelConfig, rank: int, world: int, layers: tuple[int, int] | None = None
) -> Ownership:
    """Rank ``rank``'s share of ``layers`` (default: all); experts must divide evenly."""
    e, v = config.num_experts, config.vocab_size
    if e % world:
        raise ConfigError(f"{e} routed experts do not divide among {world} lockstep ranks")
    experts = (rank * e // world, (rank + 1) * e // world) if e else None
    vocab = (rank * v // world, (rank + 1) * v // world)
    return Ownership(
        layers=layers or (0, config.num_layers), experts=experts, vocab=vocab, shard=(rank, world)
    )


def v4_head_groups(config: ModelConfig, own: Ownership) -> tuple[int, int]:
    """The output-projection groups [g0, g1) a rank owns, and with them their query heads:
    each group's projection reads its heads' outputs only, so a split along groups is exact."""
    groups, (rank, world) = int(config.hf["o_groups"]), own.shard
    if groups % world or config.num_heads % groups:
        raise ConfigError(
            f"DeepSeek-V4's {groups} output groups of {config.num_heads} heads do not "
            f"divide among {world} lockstep ranks"
        )
    return rank * groups // world, (rank + 1) * groups // world
