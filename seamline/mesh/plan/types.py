"""What the planner reads and writes: the model's byte costs, nodes, links, options, the plan.

All frozen. ``ModelSpec`` reduces a model to bytes per layer: weights held (memory), weights
read per decoded token (time: one sequence's decode is memory-bound), KV cache per token, and
the frame that crosses a stage boundary; the head's work under a batched load (see
``head_load``); and what the last stage holds besides to draft with the model's
multi-token-prediction layer (``mtp_held``). ``Plan`` round-trips through JSON so a run can
be pinned.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from seamline.config import (
    V4_PLANNING_TOKENS,
    ModelConfig,
    kv_bytes_per_token,
    sliding_layer_kv,
    v4_cache_bytes,
)
from seamline.errors import CheckpointError, SeamlineError
from seamline.ownership import Ownership
from seamline.quant.sizes import block_bytes, resident_bytes
from seamline.weights.names import mtp_plans, stage_plans

PLAN_VERSION = 1
FRAME_DTYPE_BYTES = 4  # hidden-state frames travel as float32
# Of a batched step's rows, the share that reaches the head: one per sequence sampling a token,
# while prompt rows skip it. 0.5: as many prompt tokens as generated ones.
HEAD_ROW_SHARE = 0.5
_EXPERT_TARGETS = (".experts_gate_up", ".experts_down")  # routed experts: only top-k are read
# Held whole by every rank of a lockstep group (model/moe.py, model/mla.py): the rest is divided.
_REPLICATED_TARGETS = (
    ".ffn.router",
    ".ffn.router_bias",
    ".ffn.shared.gate_up",
    ".ffn.shared.down",
    ".attn.q_a",
    ".attn.kv_a",
    "norm.weight",
    # DeepSeek-V4 (model/v4_stage.py): the shared key/value head, its compressors, indexer
    ".attn.kv",
    ".attn.compressor.kv",
    ".attn.compressor.gate",
    ".attn.indexer.q_b",
    ".attn.indexer.compressor.kv",
    ".attn.indexer.compressor.gate",
    ".ffn.table",
)
# Split across their input columns in a lockstep group: a quantized share may cut blocks and
# then keeps the blocks around it (model/linear.py ColumnWindow), up to two more a row.
_COLUMN_SPLIT_TARGETS = (".attn.o", ".ffn.down")


class PlanError(SeamlineError):
    """No plan satisfies the pool's memory, or a locked plan no longer matches the pool."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    layer_bytes: tuple[int, ...]  # weight bytes held per layer
    embed_bytes: int  # held by stage 0
    head_bytes: int  # final norm + output head, held by the last stage
    kv_bytes_per_token_per_layer: int
    bytes_per_boundary_per_token: int  # one hidden-state frame row
    tied_embeddings: bool = False  # one node owning both stores the shared matrix once
    layer_active_bytes: tuple[int, ...] = ()  # weight bytes read per token; () = layer_bytes
    layer_replicated_bytes: tuple[int, ...] = ()  # of layer_bytes, held whole by each group rank
    layer_window_bytes: tuple[
        int, ...
    ] = ()  # the most a group rank holds beyond its share (cut blocks)
    head_load_bytes: int | None = (
        None  # the head's work under load in the layers' byte scale; None: head_bytes
    )
    # KV bytes per token of each layer where layers differ (DeepSeek-V4's kinds; averaged over
    # the planned context); () = kv_bytes_per_token_per_layer for every layer
    layer_kv_bytes_per_token: tuple[int, ...] = ()
    # The multi-token-prediction layer, held by the last stage where it drafts with it (0: it
    # does not), and the embedding it reads there unless that stage owns the model's
    mtp_bytes: int = 0
    mtp_embed_bytes: int = 0

    def mtp_held(self, start: int) -> int:
        """What a last stage from layer ``start`` holds to draft with the multi-token-prediction layer."""
        return self.mtp_bytes + (self.mtp_embed_bytes if start > 0 else 0)

    def layer_kv(self) -> tuple[int, ...]:
        """KV bytes per token of each layer."""
        return (
            self.layer_kv_bytes_per_token or (self.kv_bytes_per_token_per_layer,) * self.num_layers
        )

    def active_bytes(self) -> tuple[int, ...]:
        return self.layer_active_bytes or self.layer_bytes

    def head_load(self) -> int:
        """The head's work per step under a batched load, in the layers' byte scale. With many
        rows per step a weight is read once for all of them and the time goes to work per row,
        which follows parameters, not bytes: a Q8_0 head costs per row what as many Q4
        parameters do, and only ``HEAD_ROW_SHARE`` of the rows reach it."""
        return self.head_bytes if self.head_load_bytes is None else self.head_load_bytes

    def weight_bytes(self) -> int:
        """Every weight once (the single-node footprint without KV cache)."""
        shared = self.embed_bytes if self.tied_embeddings else 0
        return (
            sum(self.layer_bytes) + self.embed_bytes + self.head_bytes - shared + self.mtp_held(0)
        )

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        name: str,
        layer_bytes: tuple[int, ...],
        embed_bytes: int,
        head_bytes: int,
        dtype_bytes: int = 4,
        layer_active_bytes: tuple[int, ...] = (),
        layer_replicated_bytes: tuple[int, ...] = (),
        layer_window_bytes: tuple[int, ...] = (),
        head_load_bytes: int | None = None,
        context: int | None = None,
    ) -> ModelSpec:
        """A spec whose KV and frame sizes come from the config (KV in ``dtype_bytes``; a V4
        model's, or a sliding layer's, per layer, averaged over ``context`` tokens)."""
        per_layer = (
            _v4_layer_kv(config, dtype_bytes, context)
            if config.is_v4
            else sliding_layer_kv(config, dtype_bytes, context)
        )
        return cls(
            name=name,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            layer_bytes=tuple(layer_bytes),
            embed_bytes=embed_bytes,
            head_bytes=head_bytes,
            kv_bytes_per_token_per_layer=max(per_layer)
            if per_layer
            else kv_bytes_per_token(config, dtype_bytes),
            bytes_per_boundary_per_token=boundary_row_bytes(config),
            layer_kv_bytes_per_token=per_layer,
            tied_embeddings=config.tie_word_embeddings,
            layer_active_bytes=tuple(layer_active_bytes),
            layer_replicated_bytes=tuple(layer_replicated_bytes),
            layer_window_bytes=tuple(layer_window_bytes),
            head_load_bytes=head_load_bytes,
        )

    @classmethod
    def from_checkpoint_shapes(
        cls,
        config: ModelConfig,
        name: str,
        shapes: Mapping[str, tuple[int, ...]],
        dtype_bytes: int,
        types: Mapping[str, str] | None = None,
        context: int | None = None,
        mtp: bool = False,
    ) -> ModelSpec:
        """Exact bytes per layer: the tensors ``stage_plans`` names for each one-layer stage,
        at the size they are kept in memory (``types``: each tensor's stored type, as
        ``TensorSource.stored_type`` gives it; quantized ones count their GGUF blocks).
        ``mtp``: the last stage drafts with the multi-token-prediction layer (``mtp_held``)."""
        types = types or {}
        held = [0] * config.num_layers
        active = [0] * config.num_layers
        replicated = [0] * config.num_layers
        window = [0] * config.num_layers
        embed = head = head_params = active_params = 0
        expert_share = (
            config.num_experts_per_tok / config.num_experts if config.num_experts else 1.0
        )
        for i in range(config.num_layers):
            for p in stage_plans(config, Ownership(layers=(i, i + 1))):
                nbytes = sum(_bytes(shapes, types, src, dtype_bytes) for src in p.sources())
                if p.target == "embed":
                    embed += nbytes
                elif p.target in ("norm.weight", "head"):
                    head += nbytes
                    head_params += sum(_params(shapes, src) for src in p.sources())
                else:
                    held[i] += nbytes
                    share = expert_share if p.target.endswith(_EXPERT_TARGETS) else 1.0
                    active[i] += round(nbytes * share)
                    active_params += round(sum(_params(shapes, src) for src in p.sources()) * share)
                    replicated[i] += nbytes if p.target.endswith(_REPLICATED_TARGETS) else 0
                    if p.target.endswith(_COLUMN_SPLIT_TARGETS):
                        window[i] += sum(
                            2 * shapes[src][0] * block_bytes(types.get(src, ""))
                            for src in p.sources()
                        )
        per_param = (
            sum(active) / active_params if active_params else 0.0
        )  # the layers' bytes per parameter
        head_load = round(head_params * per_param * HEAD_ROW_SHARE) if per_param else None
        spec = cls.from_config(
            config,
            name,
            tuple(held),
            embed,
            head,
            dtype_bytes,
            tuple(active),
            tuple(replicated),
            tuple(window),
            head_load,
            context,
        )
        return replace(spec, **_mtp_bytes(config, shapes, types, dtype_bytes)) if mtp else spec


def boundary_row_bytes(config: ModelConfig) -> int:
    """One token's row of a hidden-state frame: the residual (V4: all its streams, and the id)."""
    if config.is_v4:
        return int(config.hf["hc_mult"]) * config.hidden_size * FRAME_DTYPE_BYTES + 4
    return config.hidden_size * FRAME_DTYPE_BYTES


def _v4_layer_kv(config: ModelConfig, dtype_bytes: int, context: int | None) -> tuple[int, ...]:
    tokens = context or V4_PLANNING_TOKENS
    return tuple(
        -(-v4_cache_bytes(config, range(i, i + 1), tokens, dtype_bytes) // tokens)
        for i in range(config.num_layers)
    )


def _mtp_bytes(
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    types: Mapping[str, str],
    dtype_bytes: int,
) -> dict[str, int]:
    """The multi-token-prediction layer's bytes (the tensors of layer ``num_layers``), and those
    of the embedding it reads on a stage that does not own the model's (DeepSeek-V3's own copy,
    V4's the model's)."""
    full = Ownership.full(config)

    def held(embed: bool) -> int:
        return sum(
            _bytes(shapes, types, src, dtype_bytes)
            for p in mtp_plans(config, full, embed)
            for src in p.sources()
        )

    layer = held(False)
    return {"mtp_bytes": layer, "mtp_embed_bytes": held(True) - layer}


def _params(shapes: Mapping[str, tuple[int, ...]], name: str) -> int:
    return math.prod(shapes[name])  # _bytes has checked the name


def _bytes(
    shapes: Mapping[str, tuple[int, ...]], types: Mapping[str, str], name: str, dtype_bytes: int
) -> int:
    if name not in shapes:
        raise CheckpointError(f"checkpoint has no tensor {name}, which the model's layers need")
    return resident_bytes(shapes[name], types.get(name, ""), dtype_bytes)


@dataclass(frozen=True)
class DeviceInfo:
    """An accelerator of a node: its free memory and its weight-streaming rate."""

    device: str  # "cuda:0"
    free_memory_bytes: int
    bytes_per_second: float
    # The speed probe's batched rates: (rows, weight bytes x rows per second), rows ascending; () unknown
    batched_bytes_per_second: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    free_memory_bytes: int  # system memory
    bytes_per_second: float  # measured weight-streaming rate on its CPU: a layer takes bytes / rate
    address: str = ""  # informational
    device: str = "cpu"
    # Its accelerators; the planner places layers on the first (the one the node computes on),
    # the rest of a stage on its CPU (``plan.split``). (): the node is planned on its CPU alone.
    devices: tuple[DeviceInfo, ...] = ()
    # Its CPU's batched rates, as ``DeviceInfo.batched_bytes_per_second``; the planner reads none of them
    batched_bytes_per_second: tuple[tuple[int, float], ...] = ()
    fails_at_s: float | None = None  # a simulated pool: the simulator fails this node then

    def accelerator(self) -> DeviceInfo | None:
        return self.devices[0] if self.devices else None


@dataclass(frozen=True)
class LinkCost:
    """A link as the planner prices it (measured, or assumed): one-way latency and bandwidth."""

    latency_s: float  # one-way
    bandwidth_bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


DEFAULT_LINK = LinkCost(latency_s=0.0005, bandwidth_bytes_per_s=125e6)  # a 1 Gb/s LAN


@dataclass(frozen=True)
class LinkTable:
    """Symmetric links. A pair's link: an explicit ``pairs`` entry, else the two nodes'
    ``access`` links combined (as slow as the slower end: max latency, min bandwidth), a
    node without one using ``default``."""

    default: LinkCost = DEFAULT_LINK
    access: Mapping[str, LinkCost] = field(default_factory=dict)
    pairs: Mapping[tuple[str, str], LinkCost] = field(default_factory=dict)

    @classmethod
    def of(cls, links: LinkTable | Mapping[tuple[str, str], LinkCost] | None) -> LinkTable:
        """A LinkTable as given, or one from a dict keyed by (node_a, node_b)."""
        if isinstance(links, LinkTable):
            return links
        return cls(pairs=dict(links or {}))

    def between(self, a: str, b: str) -> LinkCost:
        pair = self.pairs.get((a, b)) or self.pairs.get((b, a))
        if pair is not None:
            return pair
        la, lb = self.access.get(a, self.default), self.access.get(b, self.default)
        return LinkCost(
            max(la.latency_s, lb.latency_s), min(la.bandwidth_bytes_per_s, lb.bandwidth_bytes_per_s)
        )


@dataclass(frozen=True)
class PlanOptions:
    context_tokens: int = 4096
    batch: int = 1  # sequences decoded together
    objective: str = "throughput"  # or "latency": see the planner's module doc
    headroom_fraction: float = 0.1  # of each node's free memory, kept free
    headroom_bytes: int = 256 << 20  # the least headroom kept on any node

    def headroom(self, free_memory_bytes: int) -> int:
        return max(self.headroom_bytes, int(self.headroom_fraction * free_memory_bytes))

    def capacity(self, free_memory_bytes: int) -> int:
        """Bytes a node may fill with weights and KV cache."""
        return free_memory_bytes - self.headroom(free_memory_bytes)


@dataclass(frozen=True)
class StageAssignment:
    node_id: str
    start: int  # layers [start, end)
    end: int
    owns_embedding: bool
    owns_head: bool
    weight_bytes: int  # layers + embedding/head owned
    kv_bytes: int  # KV cache of its layers for the whole context and batch
    compute_s: float  # predicted seconds per decode step (one sequence: weight bytes read / rate)
    # A lockstep group: every rank's node, the leader (``node_id``) first; () is one node.
    # ``weight_bytes`` and ``kv_bytes`` are then per rank.
    ranks: tuple[str, ...] = ()
    load_s: float = (
        0.0  # its work per step under a batched load / rate (ModelSpec.head_load); 0: unknown
    )
    # Where its layers run (``plan.split``): None, all on the node's device (``gpu_device`` names it
    # when the planner placed them there); N, its first N layers on ``gpu_device``, the rest on its CPU.
    gpu_layers: int | None = None
    gpu_device: str = ""
    gpu_bytes: int = 0  # of ``predicted_bytes``, held on ``gpu_device``; the rest in system memory

    @property
    def under_load_s(self) -> float:
        """Its work per step under load; a plan written before that was priced: compute_s."""
        return self.load_s or self.compute_s

    @property
    def predicted_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def members(self) -> tuple[str, ...]:
        """Every node of this stage, the leader first."""
        return self.ranks or (self.node_id,)

    def device_ranges(self) -> tuple[tuple[str, int, int], ...]:
        """(device, start, end) of each part of its layers, in order; device "" is the node's own."""
        if self.gpu_layers is None:
            return ((self.gpu_device, self.start, self.end),)
        cut = self.start + self.gpu_layers
        return tuple(
            p for p in ((self.gpu_device, self.start, cut), ("cpu", cut, self.end)) if p[1] < p[2]
        )


@dataclass(frozen=True)
class Plan:
    model_name: str
    num_layers: int
    stages: tuple[StageAssignment, ...]  # pipeline order
    predicted_s_per_token: float  # compute + every hop, including last -> stage 0
    network_s_per_token: float  # the hops' share of it
    context_tokens: int
    batch: int
    objective: str = "latency"  # what the planner optimised ("throughput" or "latency")
    private: bool = (
        False  # the first and the last stage are one node's, the coordinator's (``plan.private``)
    )
    notes: tuple[
        str, ...
    ] = ()  # one line each: what the plan could not do as a node offered (a GPU too small)

    def slowest_stage_s(self) -> float:
        """The slowest stage's work per step under load: the pipeline's pace when it is full."""
        return max(s.under_load_s for s in self.stages)

    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple((s.start, s.end) for s in self.stages)

    def node_ids(self) -> tuple[str, ...]:
        return tuple(s.node_id for s in self.stages)

    def loaded_stages(self) -> tuple[StageAssignment, ...]:
        """The stages assigned one by one: a private plan's last stage goes with its first."""
        return self.stages[:-1] if self.private else self.stages

    def to_json(self) -> str:
        data = asdict(self)
        data["version"] = PLAN_VERSION
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> Plan:
        """A plan from ``to_json()`` text or the dict it decodes to."""
        try:
            data = dict(json.loads(text) if isinstance(text, str) else text)
            if data.pop("version", None) != PLAN_VERSION:
                raise PlanError(f"a plan file must have version {PLAN_VERSION}")
            stages = tuple(
                StageAssignment(**{**s, "ranks": tuple(s.get("ranks", ()))})
                for s in data.pop("stages")
            )
            return cls(stages=stages, **{**data, "notes": tuple(data.get("notes", ()))})
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise PlanError(f"a plan file must be a JSON plan ({exc})") from None
