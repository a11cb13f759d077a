"""Was a changed answer changed at a near-tie? The reference model's logits where it first differs.

Two runs of one request that choose different tokens at some position, when the reference
model (the embedded model, float32, one process) gives those two tokens logits within
``NEAR_TIE`` of each other there, differ by rounding, not by a lost or repeated token. The
answers are text, so they are encoded again; an answer that ends where the other goes on
chose the end-of-sequence token there.
"""

from __future__ import annotations

from typing import Any

import torch

from seamline.app import LocalModel

NEAR_TIE = 1e-3


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (or where one ends); None when equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


class TieJudge:
    def __init__(self, context: int) -> None:
        self.model = LocalModel.load(dtype="float32", context=context)
        eos = self.model.config.eos_token_ids
        self.eos = eos[0] if eos else -1

    def gap(self, messages: list[dict[str, Any]], calm: str, got: str) -> float | None:
        """The difference between the logits of the two answers' tokens where they first
        differ, given the prompt and what they share; None when the texts encode alike."""
        codec, engine = self.model.codec, self.model.engine
        calm_ids, got_ids = codec.encode(calm), codec.encode(got)
        at = first_difference(calm_ids, got_ids)
        if at is None:
            return None
        chosen = [ids[at] if at < len(ids) else self.eos for ids in (calm_ids, got_ids)]
        cache = engine.stage.new_cache()
        try:
            with torch.inference_mode():
                logits = engine.prefill(codec.encode_chat(messages) + calm_ids[:at], cache)
        finally:
            engine.stage.release_cache(cache)
        return abs(float(logits[chosen[0]]) - float(logits[chosen[1]]))

    def near_tie(self, messages: list[dict[str, Any]], calm: str, got: str) -> bool:
        gap = self.gap(messages, calm, got)
        return gap is not None and gap <= NEAR_TIE
