"""A node over its accelerator and its CPU (llama.cpp's ``-ngl``): a stage's first layers on
the GPU as long as they fit, the rest on the CPU.

A node with an accelerator (``NodeInfo.accelerator()``) owning the stage ``[s, e)``:
- when the whole stage (its layers with their KV cache, the embedding, the head) fits in the
  GPU's free memory less headroom, all of it runs there (``gpu_layers`` None);
- else its first k layers (with their KV cache, and the embedding when the stage owns it) go
  on the GPU, k as large as fits and below ``e - s``, and the rest with the head on the CPU,
  which must hold them (``seamline.model.devices.place_stage`` places a stage so). k = 0: the GPU
  holds nothing, and the plan says why in one line (``gpu_note``).
A layer takes its bytes read per token / the rate of the device holding it. In a split the head
is priced at the CPU's rate (a tied head shares the embedding's table, on the GPU: a slight
overestimate there). Headroom is kept on both memories as ``PlanOptions.headroom`` says.

``split_stage`` places one stage (``price_route``), ``split_band`` every range of a node at once
(the planner's DP), with the same arithmetic: the two agree exactly (tests check).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from seamline.mesh.plan.types import ModelSpec, NodeInfo, PlanOptions

GIB = 1 << 30


@dataclass(frozen=True)
class Split:
    """Where one stage's layers run on one node, and what that costs."""

    gpu_layers: int | None  # as ``StageAssignment.gpu_layers``
    device: str  # the accelerator ("" for a node without one)
    gpu_bytes: int  # held on the accelerator
    cpu_bytes: int  # held in system memory
    read_s: float  # seconds per token (one sequence)
    load_s: float  # seconds of work per step under load
    fits: bool


def capacities(node: NodeInfo, options: PlanOptions) -> tuple[int, int]:
    """(system, accelerator) bytes the node may fill with weights and KV cache; 0 without one."""
    acc = node.accelerator()
    gpu = max(0, options.capacity(acc.free_memory_bytes)) if acc is not None else 0
    return options.capacity(node.free_memory_bytes), gpu


def planning_rate(node: NodeInfo, options: PlanOptions, model_bytes: float) -> float:
    """One rate standing for the node where nodes are ranked: the bytes of the model it can
    hold read at its GPU's rate as far as the GPU holds them, the rest at its CPU's."""
    acc = node.accelerator()
    cpu, gpu = capacities(node, options)
    held = min(float(model_bytes), float(cpu + gpu))
    if acc is None or held <= 0:
        return node.bytes_per_second
    on_gpu = min(held, float(gpu))
    return held / (on_gpu / acc.bytes_per_second + (held - on_gpu) / node.bytes_per_second)


def split_stage(
    model: ModelSpec,
    options: PlanOptions,
    node: NodeInfo,
    s: int,
    e: int,
    sizes: tuple[int, int, int],
) -> Split:
    """Where ``node`` runs the layers ``[s, e)`` (module doc), and its time per token;
    ``sizes``: the range's (weights, KV, bytes read per token), as ``pricing.range_bytes``."""
    weights, kv, read = sizes
    load = read - model.head_bytes + model.head_load() if e == model.num_layers else read
    need = weights + kv
    cpu_cap, gpu_cap = capacities(node, options)
    acc = node.accelerator()
    if acc is None:
        rate = node.bytes_per_second
        return Split(None, "", 0, need, read / rate, load / rate, need <= cpu_cap)
    if need <= gpu_cap:
        rate = acc.bytes_per_second
        return Split(None, acc.device, need, 0, read / rate, load / rate, True)
    k, gpu_bytes = _gpu_share(model, options, s, e, gpu_cap)
    on_gpu = sum(model.active_bytes()[s : s + k])
    g, c = acc.bytes_per_second, node.bytes_per_second
    return Split(
        k,
        acc.device,
        gpu_bytes,
        need - gpu_bytes,
        on_gpu / g + (read - on_gpu) / c,
        on_gpu / g + (load - on_gpu) / c,
        need - gpu_bytes <= cpu_cap,
    )


def _gpu_share(model: ModelSpec, options: PlanOptions, s: int, e: int, cap: int) -> tuple[int, int]:
    """(k, bytes): the most first layers of ``[s, e)`` below all of them that fit in ``cap``
    with their KV cache, and the embedding when ``s`` is 0."""
    per_token = options.context_tokens * options.batch
    kv = model.layer_kv()
    used = model.embed_bytes if s == 0 else 0
    k = 0
    while s + k < e - 1 and used + model.layer_bytes[s + k] + kv[s + k] * per_token <= cap:
        used += model.layer_bytes[s + k] + kv[s + k] * per_token
        k += 1
    return k, used if k else 0


def split_band(
    held: np.ndarray,
    active: np.ndarray,
    embed: float,
    tables: tuple[np.ndarray, np.ndarray, np.ndarray],
    cpu: tuple[float, float],
    gpu: tuple[float, float],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``split_stage`` for every range of a band table at once: (fits, seconds per token,
    seconds under load), each [D, L+1] as ``tables`` = (mem, read, load) ([d, e]: the range
    ``[e-1-d, e)``). ``held``/``active``: cumulative bytes held (weights + KV) and read per
    layer, [L+1]; ``cpu``, ``gpu``: (capacity, rate)."""
    mem, read, load = tables
    (cpu_cap, cpu_rate), (gpu_cap, gpu_rate) = cpu, gpu
    D, width = mem.shape
    e = np.arange(width)[None, :]
    s = np.maximum(e - 1 - np.arange(D)[:, None], 0)  # invalid ranges are inf in ``mem`` already
    starts = np.arange(width)
    room = held + gpu_cap - np.where(starts == 0, embed, 0.0)
    most = np.maximum(
        np.searchsorted(held, room, side="right") - 1 - starts, 0
    )  # layers from each start
    k = np.maximum(
        np.minimum(most[s], e - s - 1), 0
    )  # a split keeps one layer (and the head) off it
    on_gpu_mem = held[s + k] - held[s] + np.where((s == 0) & (k > 0), embed, 0.0)
    on_gpu = active[s + k] - active[s]
    whole = mem <= gpu_cap
    fits = whole | (mem - on_gpu_mem <= cpu_cap)
    t = np.where(whole, read / gpu_rate, on_gpu / gpu_rate + (read - on_gpu) / cpu_rate)
    t_load = np.where(whole, load / gpu_rate, on_gpu / gpu_rate + (load - on_gpu) / cpu_rate)
    return fits, t, t_load


def gpu_note(model: ModelSpec, options: PlanOptions, node: NodeInfo, s: int, e: int) -> str:
    """The line a plan gives for a stage whose node's GPU holds none of its layers."""
    acc = node.accelerator()
    assert acc is not None
    per_token = options.context_tokens * options.batch
    first = (
        model.layer_bytes[s]
        + model.layer_kv()[s] * per_token
        + (model.embed_bytes if s == 0 else 0)
    )
    with_embed = " and the embedding" if s == 0 else ""
    return (
        f"node {node.node_id}: {acc.device} has {_gib(acc.free_memory_bytes)} free "
        f"({_gib(capacities(node, options)[1])} after headroom), less than layer {s} needs there "
        f"({_gib(first)} with its KV cache{with_embed}): layers [{s},{e}) run on its CPU"
    )


def shortfall_note(need: int, offers: Sequence[int], nodes: Sequence[NodeInfo]) -> str:
    """A refusal's plain words when the pool is short of bytes: by how much, and which of its
    nodes (the smallest that covers the shortfall, else as many of the largest as it takes) to add."""
    short = need - sum(offers)
    if short <= 0:
        return ""
    said = (
        f"; the pool holds {sum(offers) / GIB:.1f} GiB after headroom and the model needs "
        f"{need / GIB:.1f} GiB: {short / GIB:.1f} GiB short"
    )
    covers = [i for i in range(len(nodes)) if offers[i] >= short]
    i = (
        min(covers, key=lambda j: offers[j])
        if covers
        else max(range(len(nodes)), key=lambda j: offers[j])
    )
    if offers[i] <= 0:  # no node offers anything after headroom: none is worth copying
        return said
    count = -(-short // offers[i])
    free = (
        nodes[i].free_memory_bytes + sum(d.free_memory_bytes for d in nodes[i].devices[:1])
    ) / GIB
    like = (
        f"one more node like {nodes[i].node_id!r}"
        if count == 1
        else f"{count} more nodes like {nodes[i].node_id!r}"
    )
    return f"{said}; {like} ({free:.1f} GiB free{' each' if count > 1 else ''}) would cover it"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"
