"""One party of `seamline bench quant` in its own process (protocol: ``bench/driver.py``).

``python -m seamline.bench.quant_driver PARTY MODEL DTYPE THREADS PROMPT_JSON`` with PARTY one
of ``quantized`` (seamline on the GGUF blocks, int8 activations in the matmuls), ``exact``
(on the blocks, DTYPE activations: ``SEAMLINE_QUANT_ACTIVATIONS=exact``), ``dequant`` (every
weight dequantised to DTYPE at load) and ``llamacpp`` (llama-cpp-python on the same file). Each
``measure N`` times a 512-token prefill, then N greedy decode steps after the prompt, and
prints ``{"decode_tok_s", "prefill_tok_s"}``. Ready line: ``{"party", "load_s"}``, or
``{"party", "unavailable": reason}`` when llama-cpp-python is missing.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

PREFILL_TOKENS = 512
CONTEXT = 2048


class Party:
    """A model behind two timed calls: prefill(ids) -> None, decode(prompt, n) -> tok/s."""

    prefill: Callable[[list[int]], None]
    decode: Callable[[list[int], int], float]


def seamline_party(model: str, dtype: str, dequantise: bool, int8: bool) -> Party:
    from seamline.app import LocalModel
    from seamline.model.linear import dequantize_weights
    from seamline.quant import matmul
    from seamline.weights.loader import DTYPES

    matmul.INT8_ACTIVATIONS = int8
    engine = LocalModel.load(model, dtype, CONTEXT).engine
    if dequantise:
        dequantize_weights(engine.stage, DTYPES[dtype])
    party = Party()

    def decode(prompt: list[int], steps: int) -> float:
        cache = engine.stage.new_cache()
        token, position = int(torch.argmax(engine.prefill(prompt, cache))), len(prompt)
        start = time.perf_counter()
        for _ in range(steps):
            logits = engine.stage(torch.tensor([token]), position, cache)[-1]
            token, position = int(torch.argmax(logits)), position + 1
        return steps / (time.perf_counter() - start)

    def prefill(ids: list[int]) -> None:
        engine.prefill(ids, engine.stage.new_cache())

    party.prefill, party.decode = prefill, decode
    return party


def llamacpp_party(model: str, threads: int) -> Party:
    import llama_cpp
    import llama_cpp.llama_cpp as api
    import numpy as np

    defaults = api.llama_model_default_params

    def no_repack() -> Any:  # its AMX repacking crashes on this kind of VM (COMPUTE.md)
        params = defaults()
        params.use_extra_bufts = False
        return params

    api.llama_model_default_params = no_repack
    llm = llama_cpp.Llama(model_path=model, n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads,
                          n_batch=PREFILL_TOKENS, n_ubatch=PREFILL_TOKENS, verbose=False)  # fmt: skip
    party = Party()

    def prefill(ids: list[int]) -> None:
        llm.reset()
        llm.eval(ids)

    def decode(prompt: list[int], steps: int) -> float:
        prefill(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        start = time.perf_counter()
        for _ in range(steps):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return steps / (time.perf_counter() - start)

    party.prefill, party.decode = prefill, decode
    return party


def make_party(name: str, model: str, dtype: str, threads: int) -> Party:
    if name == "llamacpp":
        return llamacpp_party(model, threads)
    return seamline_party(model, dtype, dequantise=name == "dequant", int8=name == "quantized")


def main(argv: list[str]) -> None:
    name, model, dtype, threads, prompt_json = argv
    torch.set_num_threads(int(threads))
    prompt: list[int] = json.loads(prompt_json)
    long_prompt = (prompt * (PREFILL_TOKENS // len(prompt) + 1))[:PREFILL_TOKENS]
    start = time.perf_counter()
    try:
        party = make_party(name, model, dtype, int(threads))
    except ImportError as exc:
        print(json.dumps({"party": name, "unavailable": str(exc)}), flush=True)
        return
    party.decode(prompt, 4)  # warm-up
    print(json.dumps({"party": name, "load_s": round(time.perf_counter() - start, 2)}), flush=True)
    for line in sys.stdin:
        if line.split()[:1] != ["measure"]:
            break
        began = time.perf_counter()
        party.prefill(long_prompt)
        prefill = PREFILL_TOKENS / (time.perf_counter() - began)
        decode = party.decode(prompt, int(line.split()[1]))
        print(json.dumps({"decode_tok_s": round(decode, 2), "prefill_tok_s": round(prefill, 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
