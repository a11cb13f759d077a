"""Drafts from a smaller model with the same vocabulary (``--draft-model PATH``), on one process.

The drafting model reads the sequence so far and proposes its greedy continuation, one token
at a time, as many as the window takes. It keeps the caches of the sequences it drafted for
lately (``SLOTS``, within ``budget_bytes``: the least recently used go first), each with the
tokens it holds: a call
takes the cache whose tokens are the longest beginning of the history, computes only the rest
and writes its drafts' positions, which the next call writes over. A draft is only a
proposal: the target model's own draw keeps or rejects it. A server gives the drafting caches
their share of its KV budget (``draft_share``), as the target's caches and the draft's grow
together, token for token.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from seamline.config import ModelConfig
from seamline.errors import ConfigError
from seamline.model.cache import SequenceCache
from seamline.model.stage import Stage

SLOTS = 64  # sequences whose drafting caches are kept


class DraftModel:
    """A ``DraftSource``: ``draft(history, limit)`` -> up to ``limit`` greedy tokens after it."""

    def __init__(self, stage: Stage, slots: int = SLOTS, budget_bytes: int = 0) -> None:
        """``budget_bytes``: the most the kept caches may hold (0: no bound but ``slots``)."""
        self.stage = stage
        self.slots = slots
        self.budget_bytes = budget_bytes
        self._caches: OrderedDict[int, tuple[list[int], SequenceCache]] = OrderedDict()
        self._next_key = 0

    @classmethod
    def load(cls, path: str | Path, target: ModelConfig, dtype: torch.dtype) -> DraftModel:
        """The model at ``path`` (its activations in ``dtype``, the target's); refused, naming
        both, unless its vocabulary is the target's."""
        from seamline.weights.loader import load_stage, open_source

        source = open_source(Path(path))
        config = ModelConfig.from_hf_dict(source.config_dict())
        if config.vocab_size != target.vocab_size:
            raise ConfigError(
                f"--draft-model {path}: its vocabulary has {config.vocab_size} tokens, the model's "
                f"{target.vocab_size}: a draft model must share the model's vocabulary"
            )
        if config.is_v4:
            raise ConfigError(
                f"--draft-model {path}: a DeepSeek-V4 checkpoint cannot draft (its caches only go back a little)"
            )
        return cls(load_stage(source, dtype=dtype, config=config))

    @torch.inference_mode()
    def draft(self, history: list[int], limit: int) -> list[int]:
        if (
            limit <= 0
            or not history
            or len(history) + limit > self.stage.config.max_position_embeddings
        ):
            return []  # (past its own context the drafting model proposes nothing)
        key, held, cache = self._closest(history)
        start = min(len(held), len(history) - 1)  # the last token is run again for its logits
        logits = self.stage.forward(torch.tensor(history[start:]), start, cache, last_only=True)
        drafts: list[int] = []
        while True:
            drafts.append(int(logits[-1].float().argmax()))
            if len(drafts) == limit:
                break
            logits = self.stage.forward(
                torch.tensor(drafts[-1:]), len(history) + len(drafts) - 1, cache, last_only=True
            )
        self._caches[key] = (list(history), cache)
        self._caches.move_to_end(key)
        self._evict()
        return drafts

    def held_bytes(self) -> int:
        return sum(cache.nbytes() for _, cache in self._caches.values())

    def _evict(self) -> None:
        """The least recently used caches go while the kept ones hold more than the budget (the
        one just used stays)."""
        while self.budget_bytes and len(self._caches) > 1 and self.held_bytes() > self.budget_bytes:
            self._caches.popitem(last=False)

    def _closest(self, history: list[int]) -> tuple[int, list[int], SequenceCache]:
        """The kept cache whose tokens are the longest beginning of ``history`` (that sequence's,
        grown since), else a fresh one (the least recently used goes when all slots are taken)."""
        beginnings = [
            (len(held), key)
            for key, (held, _) in self._caches.items()
            if len(held) <= len(history) and history[: len(held)] == held
        ]
        if beginnings:
            key = max(beginnings)[1]
            return key, *self._caches[key]
        if len(self._caches) >= self.slots:
            self._caches.popitem(last=False)
        self._next_key += 1
        return self._next_key, [], self.stage.new_cache()


def draft_share(budget: int, target: Stage, drafting: Stage) -> int:
    """The drafting caches' bytes of a KV budget of ``budget``: as their bytes per token are to the
    target's and theirs together (each sequence drafted for holds both, the same length)."""
    mine, theirs = drafting.cache_bytes(1), target.cache_bytes(1)
    return budget * mine // (mine + theirs) if mine + theirs else 0
