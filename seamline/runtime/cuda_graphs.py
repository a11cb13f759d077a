"""A GPU stage's decode steps replayed as CUDA graphs, one per bucket of rows (1, 2, 4, ... 64).

At one token a step of a small model launches a few hundred kernels, and launching them from
Python takes longer than running them. A step whose rows are all one-token decode rows is
captured once per bucket and then replayed: before each replay the host writes the rows' token
ids and, per layer, each row's position and cache buffers (``model/gpu_static.py``'s table) into
pinned buffers, copied in with the replay; rows past the step's count are padding that write to
a scratch cache and are not read. Prefill rows, speculative windows and stages the capture does
not cover (MoE, latent attention, a lockstep group, a GPU-and-CPU span) run eagerly, as does a
bucket whose capture failed (said once).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from seamline.model.attention import GQAttention
from seamline.model.cache import SequenceCache, Span
from seamline.model.gpu_static import static_tables
from seamline.model.layers import GatedMLP
from seamline.model.stage import Stage

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
log = logging.getLogger(__name__)
_BY_STAGE: weakref.WeakKeyDictionary[Stage, GraphedDecode] = weakref.WeakKeyDictionary()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [bucket] token ids, on the device
    tables: torch.Tensor  # [layers, 4, bucket] int64, on the device
    host_ids: torch.Tensor  # pinned twins, filled before each replay
    host_tables: torch.Tensor
    logits: torch.Tensor  # [bucket, vocab]: the replay's output
    tables_read: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # the rotary tables the graph reads, kept alive


def fill_tables(
    tables: np.ndarray,
    attention: Sequence[tuple[int, GQAttention]],
    spans: Sequence[Span],
    scratch: SequenceCache,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """``tables`` [layers, 4, bucket]: per layer, each row's position and its cache's addresses and
    capacity (the caches grown to hold the row first); rows past the spans' are padding that
    write position 0 of ``scratch``."""
    bucket = tables.shape[2]
    for slot, (layer, attn) in enumerate(attention):
        entries = [
            (s.start, *_buffers(s.cache, layer, attn, s.start + 1, dtype, device)) for s in spans
        ]
        pad = (0, *_buffers(scratch, layer, attn, 1, dtype, device))
        tables[slot] = np.array(entries + [pad] * (bucket - len(spans)), dtype=np.int64).T


def _buffers(
    cache: SequenceCache,
    layer: int,
    attn: GQAttention,
    end: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[int, int, int]:
    keys, values = cache.layer(layer).reserve(attn.kv_heads, attn.head_dim, end, dtype, device)
    return keys.data_ptr(), values.data_ptr(), keys.shape[1]


class GraphedDecode:
    def __init__(self, stage: Stage, context_length: int) -> None:
        self.stage = stage
        self.context = context_length
        self.device = stage.input_device
        self.dtype = stage.compute_dtype
        self.attention = [(int(i), block.attn) for i, block in stage.layers.items()]
        self.captured: dict[int, _Captured] = {}
        self.failed: set[int] = set()
        self.pool = torch.cuda.graph_pool_handle()
        self.scratch = SequenceCache([i for i, _ in self.attention])  # padding rows write here

    @classmethod
    def for_stage(cls, stage: object, context_length: int) -> GraphedDecode | None:
        """The stage's graphs (kept with it: every request's executor replays the same ones), or
        None where a capture would not cover its steps."""
        if not cls.fits(stage):
            return None
        graphs = _BY_STAGE.get(stage)  # type: ignore[arg-type]
        if graphs is None or graphs.context != context_length:
            graphs = _BY_STAGE[stage] = cls(stage, context_length)  # type: ignore[arg-type,index]
        return graphs

    @staticmethod
    def fits(stage: object) -> bool:
        """A whole dense GQA model on one CUDA device, alone (what a capture covers)."""
        if type(stage) is not Stage or stage.mtp is not None or stage.comm.world != 1:
            return False
        if stage.embed is None or stage.head is None or stage.input_device.type != "cuda":
            return False
        blocks = list(stage.layers.values())
        return all(
            isinstance(b.attn, GQAttention)
            and b.attn.gpu_decode
            and isinstance(b.ffn, GatedMLP)
            and b.input_norm.weight.device == stage.input_device
            for b in blocks
        )

    def run(self, ids: Sequence[int], spans: Sequence[Span]) -> torch.Tensor | None:
        """Logits [rows, vocab] (on the device) of one-token rows ``ids`` at ``spans``, or None
        when this step is not one the graphs cover."""
        rows = len(ids)
        bucket = next((b for b in BUCKETS if b >= rows), 0)
        if not bucket or bucket in self.failed or max(s.start for s in spans) + 1 > self.context:
            return None
        captured = self.captured.get(bucket) or self._capture(bucket)
        if captured is None:
            return None
        self._fill(captured, ids, spans)
        captured.ids.copy_(captured.host_ids, non_blocking=True)
        captured.tables.copy_(captured.host_tables, non_blocking=True)
        captured.graph.replay()
        return captured.logits[:rows]

    def _fill(self, captured: _Captured, ids: Sequence[int], spans: Sequence[Span]) -> None:
        """The pinned ids and tables of this step; padding rows read and write the scratch cache."""
        rows = len(ids)
        host_ids = captured.host_ids.numpy()
        host_ids[:rows], host_ids[rows:] = ids, 0
        fill_tables(
            captured.host_tables.numpy(),
            self.attention,
            spans,
            self.scratch,
            self.dtype,
            self.device,
        )

    def _capture(self, bucket: int) -> _Captured | None:
        try:
            return self._record(bucket)
        except Exception as exc:  # eager steps still answer; say why once
            self.failed.add(bucket)
            log.warning(
                "decode steps of %d rows run without a CUDA graph: %s",
                bucket,
                str(exc).splitlines()[0],
            )
            return None

    def _record(self, bucket: int) -> _Captured:
        read = [
            attn.rope.tables(self.context + 1, self.dtype) for _, attn in self.attention
        ]  # grown now
        layers = len(self.attention)
        ids = torch.zeros(bucket, dtype=torch.long, device=self.device)
        tables = torch.zeros(layers, 4, bucket, dtype=torch.int64, device=self.device)
        host_ids = torch.zeros(bucket, dtype=torch.long, pin_memory=True)
        host_tables = torch.zeros(layers, 4, bucket, dtype=torch.int64, pin_memory=True)
        captured = _Captured(torch.cuda.CUDAGraph(), ids, tables, host_ids, host_tables, ids, read)
        self._fill(captured, [0] * bucket, [Span(i, 1, 0, self.scratch) for i in range(bucket)])
        tables.copy_(host_tables)
        spans = [
            Span(i, 1, 0, self.scratch) for i in range(bucket)
        ]  # the attention reads the tables instead
        views = {layer: tables[slot] for slot, (layer, _) in enumerate(self.attention)}
        with static_tables(views):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: kernels compiled, workspaces allocated
                for _ in range(2):
                    self.stage.forward_batch(ids, spans)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(captured.graph, pool=self.pool):
                captured.logits = self.stage.forward_batch(ids, spans)
        self.captured[bucket] = captured
        return captured
