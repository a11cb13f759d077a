"""Model specs and nodes for planner tests."""

from __future__ import annotations

from seamline.mesh.plan.types import (
    ModelSpec,
    NodeInfo,
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
