"""One party of `seamline bench quant` in its own process (protocol: ``bench/driver.py``).

``python -m seamline_bench.quant_driver PARTY MODEL THREADS PROMPT_JSON [LLAMA_BENCH]`` with
PARTY one of ``default`` (seamline as a user gets it with no flag, ``--precision fast``:
bfloat16 activations rounded to int8 blocks in the matmuls, as llama.cpp), ``exact``
(``--precision exact``: float32 activations, the blocks decoded as gguf-py decodes them),
``dequant`` (the default with every weight dequantised to bfloat16 at load) and ``llamacpp``
(the binary ``LLAMA_BENCH``, llama.cpp's own `llama-bench`, on the same file).
Each ``measure N`` times a 512-token prefill, then N greedy decode steps after the prompt, and
prints ``{"decode_tok_s", "prefill_tok_s"}``. Ready line: ``{"party", "load_s"}``, or
``{"party", "unavailable": reason}`` when there is no llama-bench.

llama.cpp runs as `llama-bench` rather than through llama-cpp-python built with the same
flags: it is the binary the throughput benchmark builds beside `llama-server` (one build,
one set of flags, reported once), it is how llama.cpp measures itself (no Python call and no
copy of the whole vocabulary's logits per token), and it leaves the installed packages alone.
Its decode runs ``-n N`` at a depth of the prompt's length (``-d``), its prefill ``-p 512``
from an empty cache, as seamline's; each ``measure`` is one run of each (``-r 1``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

PREFILL_TOKENS = 512
CONTEXT = 2048
PRECISION = {
    "default": "fast",
    "exact": "exact",
    "dequant": "fast",
}  # each seamline party's --precision

# measure(long prompt, prompt, decode steps) -> {"decode_tok_s", "prefill_tok_s"}
Measure = Callable[[list[int], list[int], int], dict[str, float]]


def seamline_party(name: str, model: str) -> Measure:
    """seamline's engine in this process, as party ``name`` runs it."""
    from seamline.app import LocalModel
    from seamline.model.linear import dequantize_weights
    from seamline.weights.loader import DTYPES

    loaded = LocalModel.load(
        model, None, CONTEXT, PRECISION[name]
    )  # as the commands load it, with no --dtype
    engine = loaded.engine
    if name == "dequant":
        dequantize_weights(engine.stage, DTYPES[loaded.precision.dtype])

    def decode(prompt: list[int], steps: int) -> float:
        cache = engine.stage.new_cache()
        token, position = int(torch.argmax(engine.prefill(prompt, cache))), len(prompt)
        start = time.perf_counter()
        for _ in range(steps):
            logits = engine.stage(torch.tensor([token]), position, cache)[-1]
            token, position = int(torch.argmax(logits)), position + 1
        return steps / (time.perf_counter() - start)

    def measure(long_prompt: list[int], prompt: list[int], steps: int) -> dict[str, float]:
        began = time.perf_counter()
        engine.prefill(long_prompt, engine.stage.new_cache())
        prefill = len(long_prompt) / (time.perf_counter() - began)
        return {"decode_tok_s": round(decode(prompt, steps), 2), "prefill_tok_s": round(prefill, 1)}

    decode([1, 2, 3, 4], 4)  # warm-up
    return measure


def llama_bench_party(binary: str, model: str, threads: int) -> Measure:
    """llama.cpp's `llama-bench` on ``model``, one run per figure."""

    def rate(*test: str) -> float:
        command = [binary, "-m", model, "-t", str(threads), "-r", "1", "-o", "json", *test]
        out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"llama-bench exited with {out.returncode}: {out.stderr[-1500:]}")
        rows: list[dict[str, Any]] = json.loads(out.stdout)
        return float(rows[-1]["avg_ts"])

    def measure(long_prompt: list[int], prompt: list[int], steps: int) -> dict[str, float]:
        prefill = rate("-p", str(len(long_prompt)), "-n", "0")
        decode = rate("-p", "0", "-n", str(steps), "-d", str(len(prompt)))
        return {"decode_tok_s": round(decode, 2), "prefill_tok_s": round(prefill, 1)}

    return measure


def main(argv: list[str]) -> None:
    name, model, threads, prompt_json = argv[:4]
    torch.set_num_threads(int(threads))
    prompt: list[int] = json.loads(prompt_json)
    long_prompt = (prompt * (PREFILL_TOKENS // len(prompt) + 1))[:PREFILL_TOKENS]
    start = time.perf_counter()
    if name == "llamacpp":
        if len(argv) < 5 or not argv[4]:
            print(json.dumps({"party": name, "unavailable": "no llama-bench binary"}), flush=True)
            return
        measure = llama_bench_party(argv[4], model, int(threads))
    else:
        measure = seamline_party(name, model)
    print(json.dumps({"party": name, "load_s": round(time.perf_counter() - start, 2)}), flush=True)
    for line in sys.stdin:
        if line.split()[:1] != ["measure"]:
            break
        print(json.dumps(measure(long_prompt, prompt, int(line.split()[1]))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
