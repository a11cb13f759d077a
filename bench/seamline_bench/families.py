"""`seamline bench families`: the newer families (gpt-oss, Gemma 3, GLM-4.5) split over two
machines, and what their sliding windows save in KV cache.

Each family runs on a random checkpoint of its released model's layer shape (``family_models``:
gpt-oss-20b's, Gemma-3-1B's, GLM-4.5-Air's, 2 to 6 layers, the embedded model's vocabulary) in
llama.cpp's Q4_K_M mix, one family at a time. The timed work is a whole request, a 16-token
prompt then 32 greedy tokens (decode dominates), from the request to its last token: on the
single engine on one pinned core with one thread, and through a 2-stage mesh of two nodes
pinned to a core each, on loopback and over the emulated 1 GbE link (two network namespaces,
``split.lan_up``), as the coordinator receives the tokens. One mesh is up at a time (an idle
mesh's nodes share the two cores); the single engine takes turns with it for ``repeats`` rounds;
medians are reported. ``split_ratio_*`` = the single process's seconds /
the mesh's (target: at least 0.9 over the LAN). Where the three copies of a model (the single
process's and two meshes') would not fit ``MEMORY_BUDGET`` comfortably, the single runs come
first and its model is let go before the meshes start.

``kv_ratio_8k``: the KV bytes one sequence of 8192 tokens holds (``Stage.cache_bytes``) with the
model's sliding windows over the same config without them. Target (``kv_target_8k``): a sliding
layer holds at most its window + 16 positions of slack for speculation + one 16-position cache
block, a full layer all 8192: (sliding x (window + 32) + full x 8192) / (layers x 8192).
"""

from __future__ import annotations

import gc
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from seamline.app import LocalModel
from seamline.config import ModelConfig
from seamline.params import SamplingParams
from seamline_bench.driver import median
from seamline_bench.family_models import SHAPES, VOCAB, family_path, file_types, shape_summary
from seamline_bench.split import (
    LAN_DELAY_MS,
    LAN_RATE,
    lan_down,
    lan_driver,
    lan_up,
    one_core,
    pinned_driver,
)
from seamline_bench.split_driver import fixed_prompt

FAMILIES = tuple(SHAPES)
PROMPT_TOKENS = 16
TOKENS = 32
CONTEXT = 2048  # the mesh driver's
DTYPE = "float32"  # activations on both sides (the mesh driver's default; exact precision)
KV_TOKENS = 8192
SPECULATION_SLACK = 16  # positions a sliding layer may keep past its window for speculation
CACHE_BLOCK = 16  # positions of one cache block
MEMORY_BUDGET = 24 << 30  # this machine's, for the three copies of one model at once
TARGETS: dict[str, Any] = {"split_ratio_lan": 0.9, "kv_ratio_8k": "<= kv_target_8k"}
ASSUMED = {
    "vocab_size": f"{VOCAB} (the embedded model's tokenizer), not the released 201088 / 262144 / 151552: "
    "the embedding and head rows are not the layer's shape",
    "weights": "random, N(0, 0.02); norms at one",
    "gemma3_layers": "6, not 4: GGUF fixes Gemma 3's pattern at every 6th layer full, so 5 sliding and 1 full",
    "glm4_moe": "GLM-4.5-Air has no sliding window: its kv_ratio_8k is 1.0 by construction",
    "types": "llama.cpp's Q4_K_M mix (gpt-oss as released keeps its experts in MXFP4); a row that is not "
    "whole 256-value blocks (widths 2880, 1152, 1408, 10944) falls back to Q5_0 or Q8_0: types.not_q4_k",
    "precision": f"exact, {DTYPE} activations, on both sides (the mesh driver's)",
}


def bench_families(
    repeats: int = 3, families: tuple[str, ...] = FAMILIES, root: Path | None = None
) -> dict[str, Any]:
    """The JSON of `seamline bench families`; ``root``: where the checkpoints are cached."""
    lan_reason = _lan_up()
    try:
        out = {name: family_or_error(name, repeats, lan_reason, root) for name in families}
    finally:
        lan_down()
    return {
        "bench": "families",
        "prompt_tokens": PROMPT_TOKENS,
        "tokens": TOKENS,
        "repeats": repeats,
        "dtype": DTYPE,
        "families": out,
        "targets": TARGETS,
        "targets_met": targets_met(out),
        "assumed": ASSUMED,
        "lan_link": f"{LAN_DELAY_MS} ms one-way, {LAN_RATE}"
        if not lan_reason
        else f"not measured: {lan_reason}",
        "lan_reason": lan_reason,
    }


def _lan_up() -> str:
    """``lan_up``'s answer, or why its script failed."""
    try:
        return lan_up()
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"the namespaces could not be made: {exc}"


def family_or_error(
    name: str, repeats: int, lan_reason: str, root: Path | None = None
) -> dict[str, Any]:
    """One family's figures; where it could not be built or run, an ``error`` string beside
    what was measured before."""
    figures: dict[str, Any] = {"shape": shape_summary(SHAPES[name])}
    try:
        path = family_path(name, root)
        figures.update(file_figures(path))
        figures.update(timed_figures(path, repeats, lan_reason))
    except Exception as exc:  # one family's failure is reported, the others still run
        figures["error"] = f"{type(exc).__name__}: {exc}"
    if name == "glm4_moe":
        figures["note"] = ASSUMED["glm4_moe"]
    return figures


def file_figures(path: Path) -> dict[str, Any]:
    """What the file holds and its KV figures."""
    config = ModelConfig.from_hf_dict(_config_dict(path))
    return {**kv_figures(config), "file_bytes": path.stat().st_size, "types": file_types(path)}


def timed_figures(path: Path, repeats: int, lan_reason: str) -> dict[str, Any]:
    """The single engine's and the meshes' rates on ``path``, and their ratios."""
    runs, stages = measure(path, repeats, lan_reason)
    single = median(runs["single"], "seconds")
    loop = median(runs["loopback"], "seconds")
    lan = median(runs["lan"], "seconds") if runs.get("lan") else None
    reference = runs["single"][0]["tokens"]
    count = len(reference)
    return {
        "split_ratio_lan": round(single / lan, 3) if lan else None,
        "split_ratio_loopback": round(single / loop, 3),
        "single_tok_s": round(count / single, 2),
        "loopback_tok_s": round(count / loop, 2),
        "lan_tok_s": round(count / lan, 2) if lan else None,
        "stages": stages,
        "generated_tokens": count,
        "tokens_match": all(r["tokens"] == reference for rs in runs.values() for r in rs),
        "runs_s": {k: [round(float(r["seconds"]), 3) for r in v] for k, v in runs.items()},
    }


def _config_dict(path: Path) -> dict[str, Any]:
    from seamline.weights.loader import open_source

    return open_source(path).config_dict()


def kv_figures(config: ModelConfig, tokens: int = KV_TOKENS) -> dict[str, Any]:
    """The KV cache of one ``tokens``-long sequence with the model's windows and without them."""
    windowed = stage_cache_bytes(config, tokens)
    plain = stage_cache_bytes(replace(config, sliding_window=0, sliding_layers=frozenset()), tokens)
    ratio, target = windowed / plain, kv_target(config, tokens)
    return {
        "kv_ratio_8k": round(ratio, 4),
        "kv_target_8k": round(target, 4),
        "kv_ratio_met": ratio <= target,
        "kv_bytes_per_token_8k": {
            "windowed": round(windowed / tokens, 1),
            "without_windows": round(plain / tokens, 1),
        },
        "sliding_window": config.sliding_window,
        "sliding_layers": sorted(config.sliding_layers),
    }


def stage_cache_bytes(config: ModelConfig, tokens: int) -> int:
    """``Stage.cache_bytes`` of the whole model ``config`` describes, in ``DTYPE`` (the stage is
    built without weights: only its shape counts)."""
    from seamline.ownership import Ownership
    from seamline.weights.loader import build_stage

    with torch.device("meta"):
        stage = build_stage(config, Ownership.full(config)).to(getattr(torch, DTYPE))
    return int(stage.cache_bytes(tokens))


def kv_target(config: ModelConfig, tokens: int = KV_TOKENS) -> float:
    """The most a windowed model may hold over a full one: each sliding layer its window plus
    the slack and one cache block (at most ``tokens``), each full layer ``tokens``."""
    kept = min(config.sliding_window + SPECULATION_SLACK + CACHE_BLOCK, tokens)
    sliding = len(config.sliding_layers)
    return (sliding * kept + (config.num_layers - sliding) * tokens) / (config.num_layers * tokens)


def measure(
    path: Path, repeats: int, lan_reason: str
) -> tuple[dict[str, list[dict[str, Any]]], list[Any]]:
    """The runs of each party (single, loopback, lan), alternating when all fit at once, and
    the mesh's stages (their layer ranges)."""
    if fits_together(path.stat().st_size):
        return rounds(
            path, repeats, lan_reason, LocalModel.load(path, dtype=DTYPE, context=CONTEXT)
        )
    singles = rounds_alone(LocalModel.load(path, dtype=DTYPE, context=CONTEXT), repeats)
    gc.collect()  # the single model's memory back before the meshes load theirs
    runs, stages = rounds(path, repeats, lan_reason, None)
    return {"single": singles, **runs}, stages


def rounds_alone(model: LocalModel, repeats: int) -> list[dict[str, Any]]:
    """The single engine's runs on their own, after a warm-up."""
    prompt = fixed_prompt(PROMPT_TOKENS, model.config.vocab_size)
    request(model, prompt[:4], 2)
    return [request(model, prompt, TOKENS) for _ in range(repeats)]


def rounds(
    path: Path, repeats: int, lan_reason: str, model: LocalModel | None
) -> tuple[dict[str, list[dict[str, Any]]], list[Any]]:
    """The meshes' runs, one mesh alive at a time (an idle mesh's nodes, pinned to the same two
    cores, would take time from the measured one), each round after the single engine's when
    ``model`` is given."""
    extra = ("--model", str(path), "--dtype", DTYPE)
    runs: dict[str, list[dict[str, Any]]] = {"single": []} if model is not None else {}
    prompt = fixed_prompt(PROMPT_TOKENS, model.config.vocab_size) if model is not None else []
    if model is not None:
        request(model, prompt[:4], 2)  # warm-up
    stages: list[Any] = []
    parties = {"loopback": lambda: pinned_driver(extra)}
    if not lan_reason:
        parties["lan"] = lambda: lan_driver(one_core_each=True, extra=extra)
    for party, start in parties.items():
        driver = start()
        try:
            driver.ask(f"measure 2 {PROMPT_TOKENS}")  # warm-up
            for _ in range(repeats):
                if model is not None:
                    runs["single"].append(request(model, prompt, TOKENS))
                runs.setdefault(party, []).append(driver.ask(f"measure {TOKENS} {PROMPT_TOKENS}"))
            stages = stages or [s["layers"] for s in driver.wait_ready()["stages"]]
        finally:
            driver.close()
    return runs, stages


def fits_together(file_bytes: int, budget: int = MEMORY_BUDGET) -> bool:
    """Whether the single process's copy and two meshes' (one copy each) fit in three quarters
    of ``budget``."""
    return 3 * file_bytes <= budget * 3 // 4


def request(model: LocalModel, prompt: list[int], tokens: int) -> dict[str, Any]:
    """The single engine on one core, one thread: the prompt, then ``tokens`` greedy tokens."""
    with one_core():
        start = time.perf_counter()
        out = list(model.engine.generate(prompt, SamplingParams(max_tokens=tokens)))
        return {"seconds": time.perf_counter() - start, "tokens": out}


def targets_met(families: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """Per family: split_ratio_lan at least its target, kv_ratio_8k within its bound (None:
    not measured)."""
    met: dict[str, bool | None] = {}
    for name, figures in families.items():
        ratio = figures.get("split_ratio_lan")
        met[f"{name}.split_ratio_lan"] = (
            None if ratio is None else bool(ratio >= TARGETS["split_ratio_lan"])
        )
        met[f"{name}.kv_ratio_8k"] = figures.get("kv_ratio_met")
    return met
