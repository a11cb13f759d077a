"""The coordinator's own copy of the model, to check what members compute (``verify``).

The coordinator packaged the checkpoint, so it holds every weight on its disk; a range is
loaded from the package when a check first needs it (memory-mapped, as a node loads its
stage) and kept while the plan has a stage of that range. Each probe or check runs on its own
cache, under one lock (a stage's step counter is shared). A lockstep group's range is computed
as the group computes it, each rank's shard on a thread (``reference_group``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from seamline.config import ModelConfig
from seamline.mesh.control.reference_group import GroupStage, load_group_stage
from seamline.model.cache import Span
from seamline.model.stage import Stage
from seamline.ownership import Ownership
from seamline.runtime import digest
from seamline.weights.fragments import FragmentSource, Manifest
from seamline.weights.loader import DTYPES, load_stage

PROBE_TOKENS = 4  # rows of a start-up probe
Range = tuple[int, int]
AnyStage = Stage | GroupStage


class Reference:
    def __init__(self, package_dir: Path, dtype: str, rows_alone: bool = False) -> None:
        self.package_dir = package_dir
        self.dtype = DTYPES[dtype]
        # this process and every stage compute int8 rows as alone (``Precision.rows_alone``):
        # their digests agree to the bit, and are held to ``digest.ALONE_TOLERANCE``
        self.rows_alone = rows_alone
        self._manifest: Manifest | None = None
        self._stages: dict[tuple[Range, int], AnyStage] = {}  # by (layers, the group's ranks)
        self.lock = threading.RLock()

    @functools.cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(self._source().manifest.config)

    def _source(self) -> FragmentSource:
        if self._manifest is None:
            self._manifest = Manifest.load(self.package_dir)
        return FragmentSource(self.package_dir, self._manifest)

    def stage(self, layers: Range, world: int = 1) -> AnyStage:
        """The layers [start, end) with the embedding and head where the range has them; for a
        lockstep group of ``world`` ranks, its shards as the group runs them."""
        with self.lock:
            key = (layers, world)
            if key not in self._stages:
                source = self._source()
                config = ModelConfig.from_hf_dict(source.manifest.config)
                self._stages[key] = (
                    load_stage(source, Ownership(layers=layers), self.dtype, config)
                    if world == 1
                    else load_group_stage(source, layers, world, self.dtype, config)
                )
            return self._stages[key]

    def loaded(self) -> list[tuple[Range, int]]:
        """The (layers, ranks) held now (read without the lock, which a check holds while it
        runs: one copy of the keys, atomic under the GIL)."""
        return list(self._stages)

    def keep_only(self, stages: Sequence[tuple[Range, int]]) -> None:
        """Let go of what no stage of the current plan has: ``stages`` are (layers, ranks)."""
        with self.lock:
            for key in [k for k in self._stages if k not in stages]:
                del self._stages[key]

    def probe_inputs(
        self, layers: tuple[int, int], generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A random probe for a stage of ``layers``: token ids, and the boundary tensor it takes
        when it has no embedding (a residual stream's scale), in its dtype."""
        ids = torch.randint(0, self.config.vocab_size, (PROBE_TOKENS,), generator=generator)
        if layers[0] == 0:
            return ids, None
        with self.lock, self._one_layer(layers[0]) as first:
            shape, dtype = first.boundary_shape, first.compute_dtype
        return ids, torch.randn(PROBE_TOKENS, *shape, generator=generator).to(dtype)

    def probe(
        self,
        layers: Range,
        ids: torch.Tensor,
        hidden: torch.Tensor | None,
        seed: int,
        world: int = 1,
    ) -> tuple[torch.Tensor, float]:
        """What a stage holding ``layers`` (a group of ``world`` ranks) answers to a probe
        (``digest.probe_output``), and its scale: computed a layer at a time, each loaded and let
        go (the coordinator holds no more than a layer of the model for a start-up check)."""
        x: torch.Tensor = ids if hidden is None else hidden
        for layer in range(*layers):
            with self.lock, self._one_layer(layer, world) as stage:
                x = self.run(stage, x, 0, stage.new_cache(), stage.head is not None, ids)
        start = (
            ids.shape[0] - 1 if layers[1] == self.config.num_layers else 0
        )  # the head's row: the last
        return digest.digest(x, start, seed), digest.scale(x, start, seed)

    @contextlib.contextmanager
    def _one_layer(self, layer: int, world: int = 1) -> Iterator[AnyStage]:
        one = ((layer, layer + 1), world)
        kept = one in self._stages
        try:
            yield self.stage(*one)
        finally:
            if not kept:
                self._stages.pop(one, None)

    def run(
        self,
        stage: AnyStage,
        inputs: torch.Tensor,
        start: int,
        cache: object,
        last_only: bool,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One row of one sequence through ``stage`` on ``cache``, as a member runs it."""
        spans = [Span(0, inputs.shape[0], start, cache)]  # type: ignore[arg-type]
        with self.lock:
            if stage.passes_ids and ids is not None:
                return stage.forward_batch(inputs, spans, last_only=last_only, ids=ids)  # type: ignore[call-arg]
            return stage.forward_batch(inputs, spans, last_only=last_only)
