"""The DeepSeek-V4 rows of `seamline bench split`: a V4-shaped model (``v4_model``, bfloat16)
on one pinned core against two pinned stages, on loopback and over the emulated 1 GbE link.

The timed work is a whole request: a 512-token prompt's prefill, then greedy tokens, from
the request to its last token (the mesh: as the coordinator receives them). Between the two
stages cross the residual's 4 streams and the tokens' ids (``v4_bytes_per_token_per_boundary``:
one decode step's frame as it goes on the wire, header and row record included).
``v4_ratio_*`` = the single process's seconds / the mesh's: its throughput relative to one
machine that could hold the whole model.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from seamline.app import LocalModel
from seamline.params import SamplingParams
from seamline_bench.driver import Driver, median
from seamline_bench.split import lan_driver, one_core, pinned_driver
from seamline_bench.split_driver import fixed_prompt
from seamline_bench.v4_model import build_v4_model
from seamline_bench.v4_parting import parting

PROMPT_TOKENS = 512
TOKENS = 32


def bench_split_v4(repeats: int, lan_reason: str) -> dict[str, Any]:
    folder = build_v4_model("bench")
    extra = ("--model", str(folder), "--dtype", "bfloat16")
    model = LocalModel.load(folder, dtype="bfloat16", context=2048)
    prompt = fixed_prompt(PROMPT_TOKENS, model.config.vocab_size)
    drivers: dict[str, Driver] = {"split_1core_each": pinned_driver(extra)}
    if not lan_reason:
        drivers["lan_1core_each"] = lan_driver(one_core_each=True, extra=extra)
    runs: dict[str, list[dict[str, Any]]] = {"single_1core": [], **{name: [] for name in drivers}}
    try:
        _request(model, prompt[:16], 2)  # warm-up
        for driver in drivers.values():
            driver.ask("measure 2 16")
        for _ in range(repeats):
            runs["single_1core"].append(_request(model, prompt, TOKENS))
            for name, driver in drivers.items():
                runs[name].append(driver.ask(f"measure {TOKENS} {PROMPT_TOKENS}"))
    finally:
        for driver in drivers.values():
            driver.close()
    result = _result(runs, model, folder.name, drivers["split_1core_each"].wait_ready(), lan_reason)
    reference = runs["single_1core"][0]["tokens"]
    parted = next(
        (r["tokens"] for rs in runs.values() for r in rs if r["tokens"] != reference), reference
    )
    found = parting(folder, prompt, reference, parted, "bfloat16")
    return result | {
        "v4_parting": found,
        "v4_near_tie_flips": int(bool(found and found["near_tie"])),
        "v4_parting_is_a_fault": bool(found and not found["near_tie"]),
    }


def _request(model: LocalModel, prompt: list[int], tokens: int) -> dict[str, Any]:
    """The single engine on one core, one thread: the prompt, then ``tokens`` greedy tokens."""
    with one_core():
        start = time.perf_counter()
        out = list(model.engine.generate(prompt, SamplingParams(max_tokens=tokens)))
        return {"seconds": time.perf_counter() - start, "tokens": out}


def boundary_frame_bytes(hc_mult: int, hidden: int) -> int:
    """One decode step's V4 frame on the wire: header, row record, residual (bfloat16), id."""
    from seamline.net.frames import Row, encode_hidden

    buffers = encode_hidden(
        [Row(1, 0, 1, 0, 0, 0)],
        torch.zeros(1, hc_mult, hidden, dtype=torch.bfloat16),
        torch.zeros(1, dtype=torch.long),
    )
    return sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)


def _result(
    runs: dict[str, list[dict[str, Any]]],
    model: LocalModel,
    name: str,
    ready: dict[str, Any],
    lan_reason: str,
) -> dict[str, Any]:
    config = model.config
    single = median(runs["single_1core"], "seconds")
    lan = median(runs["lan_1core_each"], "seconds") if runs.get("lan_1core_each") else None
    split = median(runs["split_1core_each"], "seconds")
    reference = runs["single_1core"][0]["tokens"]
    return {
        "v4_model": {
            "name": name,
            "hidden": config.hidden_size,
            "hc_mult": int(config.hf["hc_mult"]),
            "layers": config.num_layers,
            "layer_types": list(config.hf["layer_types"]),
            "mlp_layer_types": list(config.hf["mlp_layer_types"]),
            "routed_experts": config.num_experts,
            "expert_rows": config.moe_intermediate_size,
            "dtype": "bfloat16",
        },
        "v4_stages": [s["layers"] for s in ready["stages"]],
        "v4_bytes_per_token_per_boundary": boundary_frame_bytes(
            int(config.hf["hc_mult"]), config.hidden_size
        ),
        "v4_prompt_tokens": PROMPT_TOKENS,
        "v4_tokens": TOKENS,
        "v4_single_1core_s": round(single, 3),
        "v4_split_1core_each_s": round(split, 3),
        "v4_ratio_1core_each": round(single / split, 3),
        "v4_split_lan_1core_each_s": round(lan, 3) if lan else None,
        "v4_ratio_lan": round(single / lan, 3) if lan else None,
        "v4_tokens_match": all(r["tokens"] == reference for rs in runs.values() for r in rs),
        "v4_runs_s": {k: [round(float(r["seconds"]), 3) for r in v] for k, v in runs.items()},
        "v4_lan_link": "as lan_link" if lan else f"not measured: {lan_reason}",
    }
