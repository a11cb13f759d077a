"""Where a DeepSeek-V4 lockstep group's tokens part from one process's, and why.

`bench lockstep` decodes a random V4-shaped model greedily in bfloat16 on one process and on a
2-rank group. Where the answers differ, this says at which generated token, which two tokens,
and the gap between their logits there in the single process's own arithmetic (the prompt and
the shared tokens run as one prefill), then does the same for the two decoded in float32
activations. The model's weights are bfloat16, and the head multiplies in their dtype, so its
logits are bfloat16 values: two of them one bfloat16 step apart (``bfloat16_step``: 2^-5 for
logits of 4 to 8) are a tie that a group's partial sums, rounded otherwise than one process's
whole sums, may break the other way. A parting at such a gap is a near tie; one at a larger
gap would be a fault.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from seamline_bench.driver import Driver
from seamline_bench.near_tie import first_difference

DRIVER = "seamline_bench.lockstep_driver"


def bfloat16_step(value: float) -> float:
    """The distance from ``value`` to the next bfloat16 away from zero (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7) if value else 2.0**-133


def v4_parting(
    folder: Path,
    prompt: list[int],
    single: list[int],
    group: list[int],
    tokens: int,
    core0: int,
    core1: int,
) -> dict[str, Any]:
    """The parting of ``group``'s tokens from ``single``'s (both bfloat16), and of the two in
    float32: see the module."""
    if first_difference(single, group) is None:
        return {"v4_parting": None}
    float32 = _float32_tokens(folder, prompt, tokens, core0, core1)
    partings = {
        "bfloat16": parting(folder, prompt, single, group, "bfloat16"),
        "float32": parting(folder, prompt, float32["single"], float32["lockstep2"], "float32"),
    }
    found = [p for p in partings.values() if p is not None]
    ties = sum(p["near_tie"] for p in found)
    return {
        "v4_parting": partings,
        "v4_float32_tokens_match": partings["float32"] is None,
        "v4_near_tie_flips": ties,
        "v4_parting_is_a_fault": ties < len(found),
    }


def parting(
    folder: Path, prompt: list[int], single: list[int], group: list[int], dtype: str
) -> dict[str, Any] | None:
    """Where ``group``'s tokens (a group's, or a split's) first differ from ``single``'s, the two
    logits there on one process in ``dtype``, and whether they are within a bfloat16 step."""
    at = first_difference(single, group)
    if at is None or at >= min(len(single), len(group)):
        return (
            None
            if at is None
            else {"generated_token": at, "near_tie": False, "why": "one answer ended"}
        )
    first, second = _logits(folder, prompt + single[:at], single[at], group[at], dtype)
    step = bfloat16_step(max(abs(first), abs(second)))
    return {
        "generated_token": at,
        "single_token": single[at],
        "group_token": group[at],
        "single_logits": [first, second],
        "gap": first - second,
        "bfloat16_step": step,
        "near_tie": abs(first - second) <= step,
    }


def _logits(
    folder: Path, ids: list[int], first: int, second: int, dtype: str
) -> tuple[float, float]:
    """The logits of tokens ``first`` and ``second`` after ``ids``, on one process in ``dtype``."""
    from seamline.weights.loader import DTYPES, load_stage, open_source

    stage = load_stage(open_source(folder), dtype=DTYPES[dtype])
    logits = stage(torch.tensor(ids), 0, stage.new_cache(), last_only=True)[-1].float()
    return float(logits[first]), float(logits[second])


def _float32_tokens(
    folder: Path, prompt: list[int], tokens: int, core0: int, core1: int
) -> dict[str, list[int]]:
    common = ["--model", str(folder), "--prompt", ",".join(map(str, prompt)), "--dtype", "float32"]
    drivers = {
        "single": Driver(DRIVER, ["single", *common, "--core", str(core0)]),
        "lockstep2": Driver(
            DRIVER, ["group", *common, "--core", str(core0), "--peer-core", str(core1)]
        ),
    }
    try:
        for driver in drivers.values():
            driver.wait_ready()
        return {name: driver.measure(tokens)["tokens"] for name, driver in drivers.items()}
    finally:
        for driver in drivers.values():
            driver.close()
