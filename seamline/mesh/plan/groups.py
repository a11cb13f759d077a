"""Lockstep groups in a plan: N nodes share one stage when no single node can hold it.

A group of N ranks holds, per rank, 1/N of every layer's weights and of the output head
(experts, heads, feed-forward rows and vocabulary rows are divided) except the layer tensors
every rank holds whole (``ModelSpec.layer_replicated_bytes``: router, shared experts, MLA's
down-projections, norms); the whole embedding (replicated); and 1/N of the KV cache when the
KV heads divide among the ranks (else all of it: replicated KV heads, or MLA's shared
latent); no multi-token-prediction layer (a group's head is split: it drafts n-grams).
Groups are planned as one virtual node with the memory and rate of their smallest member; the
planner then places them exactly like single nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from seamline.config import ModelConfig
from seamline.errors import ConfigError
from seamline.mesh.plan.planner import plan
from seamline.mesh.plan.types import (
    LinkCost,
    LinkTable,
    ModelSpec,
    NodeInfo,
    Plan,
    PlanError,
    PlanOptions,
)
from seamline.ownership import Ownership, rank_ownership, v4_head_groups

Links = LinkTable | Mapping[tuple[str, str], LinkCost] | None
MAX_WORLD = 8


def check_world(config: ModelConfig, world: int) -> None:
    """ConfigError unless a lockstep group of ``world`` ranks can divide this model."""
    if world < 1:
        raise ConfigError(f"a lockstep group has at least one rank, not {world}")
    rank_ownership(config, 0, world)  # routed experts divide evenly
    own = Ownership(layers=(0, 1), shard=(0, world))
    own.head_range(config.num_heads)
    if config.is_v4:
        v4_head_groups(config, own)  # whole output groups of heads on each rank
        own.shard_rows(config.moe_intermediate_size * config.n_shared_experts)
    if any(not config.is_moe_layer(i) for i in range(config.num_layers)):
        own.shard_rows(config.intermediate_size)


def group_sizes(config: ModelConfig, limit: int = MAX_WORLD) -> tuple[int, ...]:
    """Every group size up to ``limit`` this model divides into (1 always)."""
    sizes = []
    for world in range(1, limit + 1):
        try:
            check_world(config, world)
        except ConfigError:
            continue
        sizes.append(world)
    return tuple(sizes)


def kv_divides(config: ModelConfig, world: int) -> bool:
    """Whether each rank of the group holds 1/world of the KV cache."""
    return not config.is_mla and config.num_kv_heads % world == 0


def group_spec(model: ModelSpec, world: int, kv_split: bool) -> ModelSpec:
    """What one rank of a ``world``-rank group holds and reads per token."""
    if world == 1:
        return model
    share = lambda values: tuple(-(-v // world) for v in values)  # noqa: E731
    kv = model.kv_bytes_per_token_per_layer
    whole = model.layer_replicated_bytes or (0,) * model.num_layers
    window = model.layer_window_bytes or (0,) * model.num_layers  # blocks kept around cut shares
    held = tuple(-(-(b - r) // world) + r + w for b, r, w in zip(model.layer_bytes, whole, window))
    return replace(
        model,
        layer_bytes=held,
        layer_active_bytes=share(model.active_bytes()),
        head_bytes=-(-model.head_bytes // world),
        tied_embeddings=False,
        head_load_bytes=-(-model.head_load() // world),
        mtp_bytes=0,
        mtp_embed_bytes=0,
        kv_bytes_per_token_per_layer=-(-kv // world) if kv_split else kv,
        layer_kv_bytes_per_token=share(model.layer_kv_bytes_per_token)
        if kv_split
        else model.layer_kv_bytes_per_token,
    )


def form_groups(nodes: Sequence[NodeInfo], world: int) -> list[tuple[NodeInfo, ...]]:
    """Nodes of similar memory together, largest first; nodes left over join no group."""
    ordered = sorted(nodes, key=lambda n: (-n.free_memory_bytes, n.node_id))
    return [tuple(ordered[i : i + world]) for i in range(0, len(ordered) - world + 1, world)]


def plan_groups(
    model: ModelSpec,
    nodes: Sequence[NodeInfo],
    links: Links,
    options: PlanOptions,
    world: int,
    kv_split: bool,
) -> Plan:
    """The best pipeline whose every stage is a lockstep group of ``world`` nodes."""
    if world == 1:
        return plan(model, nodes, links, options)
    groups = form_groups(nodes, world)
    if not groups:
        raise PlanError(
            f"lockstep groups of {world} need at least {world} nodes; the pool has {len(nodes)}"
        )
    # a rank's share is planned in system memory at its node's rate: never split over a GPU (``plan.split``)
    virtual = [
        replace(
            g[0],
            free_memory_bytes=min(n.free_memory_bytes for n in g),
            bytes_per_second=min(n.bytes_per_second for n in g),
            devices=(),
        )
        for g in groups
    ]
    members = {g[0].node_id: tuple(n.node_id for n in g) for g in groups}
    try:
        found = plan(group_spec(model, world, kv_split), virtual, links, options)
    except PlanError as exc:  # its bytes and "nodes" are per rank and per group: say so
        raise PlanError(
            f"as {len(groups)} lockstep groups of {world} nodes (bytes per rank): {exc}"
        ) from None
    return replace(found, stages=tuple(replace(s, ranks=members[s.node_id]) for s in found.stages))


def plan_auto(
    model: ModelSpec,
    nodes: Sequence[NodeInfo],
    links: Links,
    options: PlanOptions,
    config: ModelConfig,
    world: int = 0,
) -> Plan:
    """``world`` ranks per stage; 0: one node per stage when that fits, else the smallest
    group size (that the model divides into) that does."""
    if world:
        check_world(config, world)
        return plan_groups(model, nodes, links, options, world, kv_divides(config, world))
    refusals = []
    for size in group_sizes(config, min(MAX_WORLD, max(1, len(nodes)))):
        try:
            return plan_groups(model, nodes, links, options, size, kv_divides(config, size))
        except PlanError as exc:
            refusals.append(str(exc))
    raise PlanError("; ".join(refusals))
