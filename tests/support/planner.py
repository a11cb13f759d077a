"""Model specs and nodes for planner tests, and the checks every plan must pass."""

from __future__ import annotations

from seamline.mesh.plan.types import (
    ModelSpec,
    NodeInfo,
    Plan,
    PlanOptions,
)

MIB = 1 << 20


EXACT = PlanOptions(
    context_tokens=1024, batch=1, headroom_fraction=0.0, headroom_bytes=0, objective="latency"
)


def spec(
    layers: int,
    layer: int = 100 * MIB,
    embed: int = 0,
    head: int = 0,
    kv: int = 0,
    name: str = "m",
    tied: bool = False,
) -> ModelSpec:
    return ModelSpec(name, layers, 1024, (layer,) * layers, embed, head, kv, 4096, tied)


def node(node_id: str, free: int, rate: float = 1e10) -> NodeInfo:
    return NodeInfo(node_id, free, rate)


def need(model: ModelSpec, options: PlanOptions, s: int, e: int) -> int:
    """Bytes owning [s, e) takes, computed here independently of the planner."""
    L = model.num_layers
    weights = sum(model.layer_bytes[s:e]) + (model.embed_bytes if s == 0 else 0)
    weights += model.head_bytes if e == L else 0
    if s == 0 and e == L and model.tied_embeddings:
        weights -= model.embed_bytes
    return weights + model.kv_bytes_per_token_per_layer * options.context_tokens * options.batch * (
        e - s
    )


def assert_valid(p: Plan, model: ModelSpec, nodes: list[NodeInfo], options: PlanOptions) -> None:
    """Contiguous ranges covering [0, L) exactly once, distinct nodes, every node within memory."""
    by_id = {n.node_id: n for n in nodes}
    covered = [r for s in p.stages for r in range(s.start, s.end)]
    assert covered == list(range(model.num_layers))
    assert all(s.start < s.end for s in p.stages)
    assert len(set(p.node_ids())) == len(p.stages)
    assert p.stages[0].owns_embedding and p.stages[-1].owns_head
    assert not any(s.owns_embedding for s in p.stages[1:]) and not any(
        s.owns_head for s in p.stages[:-1]
    )
    for s in p.stages:
        assert s.predicted_bytes == need(model, options, s.start, s.end)
        assert s.predicted_bytes <= options.capacity(by_id[s.node_id].free_memory_bytes)
