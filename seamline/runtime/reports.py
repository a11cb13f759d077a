"""What a backend reports of its nodes and links (``Backend.report``, read by ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from seamline.runtime.speculation import SpeculationStats


@dataclass(frozen=True)
class NodeReport:
    node: str
    up: bool
    step_seconds: float | None = None  # mean decode step, over the steps so far
    kv_used_bytes: int | None = None


@dataclass(frozen=True)
class LinkReport:
    src: str
    dst: str
    rtt_seconds: float | None = None  # as last measured
    bytes_total: int | None = None  # frames sent from src to dst so far


@dataclass(frozen=True)
class MeshReport:
    nodes: list[NodeReport] = field(default_factory=list)
    links: list[LinkReport] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)  # the mesh's events so far, by kind
    speculation: SpeculationStats | None = (
        None  # windows verified, drafts made and accepted (None: none)
    )
