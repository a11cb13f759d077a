"""Where a DeepSeek-V4 lockstep group's tokens part from one process's, and why.

`bench lockstep` decodes a random V4-shaped model greedily in bfloat16 on one process and on a
2-rank group. Where the answers differ, this says at which generated token, which two tokens,
and the gap between their logits there in the single process's own arithmetic (the prompt and
the shared tokens run as one prefill: bfloat16, and float32), then decodes the same prompt on
one process and on the group in float32. Equal float32 answers and a bfloat16 gap within the
group's rounding (``BFLOAT16_TIE``: a partial sum over half the heads and experts rounds to 8
bits of mantissa differently from the whole) mean the parting is a near tie, not a fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from seamline.bench.driver import Driver
from seamline.bench.near_tie import NEAR_TIE, first_difference

BFLOAT16_TIE = 0.125  # logits of a few units: 8 mantissa bits resolve ~1/64 of them; both ranks' partial sums round
DRIVER = "seamline.bench.lockstep_driver"


def v4_parting(folder: Path, prompt: list[int], single: list[int], group: list[int], tokens: int,
               core0: int, core1: int) -> dict[str, Any]:  # fmt: skip
    """The parting of ``group``'s tokens from ``single``'s (both bfloat16): see the module."""
    at = first_difference(single, group)
    if at is None:
        return {"v4_parting": None}
    gaps = {dtype: _gap(folder, prompt + single[:at], single[at], group[at], dtype) for dtype in ("bfloat16", "float32")}
    float32 = _float32_tokens(folder, prompt, tokens, core0, core1)
    matches = float32["single"] == float32["lockstep2"]
    near_tie = matches and (abs(gaps["bfloat16"]) <= BFLOAT16_TIE or abs(gaps["float32"]) <= NEAR_TIE)
    return {
        "v4_parting": {"generated_token": at, "single_token": single[at], "group_token": group[at],
                       "gap_bfloat16": round(gaps["bfloat16"], 5), "gap_float32": round(gaps["float32"], 5)},
        "v4_float32_tokens_match": matches,
        "v4_near_tie_flips": int(near_tie),
        "v4_parting_is_a_fault": not near_tie,
    }  # fmt: skip


def _gap(folder: Path, ids: list[int], first: int, second: int, dtype: str) -> float:
    """logit[first] - logit[second] after ``ids``, on one process in ``dtype``."""
    from seamline.weights.loader import DTYPES, load_stage, open_source

    stage = load_stage(open_source(folder), dtype=DTYPES[dtype])
    logits = stage(torch.tensor(ids), 0, stage.new_cache(), last_only=True)[-1].float()
    return float(logits[first] - logits[second])


def _float32_tokens(folder: Path, prompt: list[int], tokens: int, core0: int, core1: int) -> dict[str, list[int]]:
    common = ["--model", str(folder), "--prompt", ",".join(map(str, prompt)), "--dtype", "float32"]
    drivers = {"single": Driver(DRIVER, ["single", *common, "--core", str(core0)]),
               "lockstep2": Driver(DRIVER, ["group", *common, "--core", str(core0), "--peer-core", str(core1)])}
    try:
        for driver in drivers.values():
            driver.wait_ready()
        return {name: driver.measure(tokens)["tokens"] for name, driver in drivers.items()}
    finally:
        for driver in drivers.values():
            driver.close()
