"""`seamline bench conformance`: the same text through seamline and llama-server on the same
files, and llama.cpp's vocabulary vectors through seamline's tokenizers.

Per file and precision: ``prompt_ids_equal`` (seamline's ids against llama-server's
/tokenize), ``greedy_equal`` of ``prompts`` (32 tokens each), ``near_ties`` (partings where
llama.cpp's own top-2 gap is under twice the largest logit difference, each listed),
``top5_equal`` and ``max_logit_diff`` (``conformance_compare``). ``exact`` is seamline at
``--precision exact`` against llama-server with an f32 KV cache; ``fast`` is both at their
defaults. Files: the real Gemma 3 270M Q4_K_M from llama.cpp's converter.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from seamline.bench.conformance_compare import Answer, Comparison, compare, summarise
from seamline.bench.conformance_files import add_converter_files, files_only
from seamline.bench.conformance_llama import LlamaReference
from seamline.bench.conformance_vocab import vocab_vectors
from seamline.bench.llama_server import llama_cpp_build
from seamline.bench.references import gemma3_270m

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "import numpy as np\n\n",
    "Water boils at a temperature of",
    "The quick brown fox",
    "1, 2, 3, 4, 5,",
    "In 1969, the first humans",
    "The best way to learn a new language is",
    "SELECT name, age FROM users WHERE",
    "My favourite recipe for pancakes:",
    "Photosynthesis is the process by which",
    "Der schnellste Weg nach Berlin ist",
    "The largest planet in our solar system is",
    "<html>\n<head>\n<title>",
    "Q: What is 12 times 12?\nA:",
    "The main causes of the French Revolution were",
    "Dear hiring manager,\n\n",
    "A haiku about autumn:\n",
)
PRECISIONS = ("exact", "fast")


def bench_conformance(tokens: int = 32, **_: Any) -> dict[str, Any]:
    build, why = llama_cpp_build()
    if build is None:
        raise RuntimeError(why)
    files = {"gemma3-270m-q4_k_m (real, llama.cpp's converter)": gemma3_270m()}
    out: dict[str, Any] = {"llama_cpp": build.describe(), "tokens": tokens, "files": {}}
    if files_only():  # SEAMLINE_CONFORMANCE_ONLY=files: the converter files alone
        add_converter_files(out, build, PROMPTS, tokens)
        return out
    with tempfile.TemporaryDirectory(prefix="seamline-conformance-") as tmp:
        for name, path in files.items():
            out["files"][name] = {
                p: _file_figures(build.server, path, p, tokens, Path(tmp)) for p in PRECISIONS
            }
    out["vocab"] = vocab_vectors()
    add_converter_files(out, build, PROMPTS, tokens)
    return out


def _file_figures(
    server: Path, gguf: Path, precision: str, tokens: int, tmp: Path
) -> dict[str, Any]:
    ours = _seamline_answers(gguf, precision, tokens)
    reference = LlamaReference(server, gguf, precision == "exact", threads=2, log=tmp / "llama.log")
    try:
        rows: list[Comparison] = []
        ids_equal = 0
        for prompt, (our_ids, answer) in zip(PROMPTS, ours):
            ids_equal += our_ids == reference.prompt_ids(prompt)
            rows.append(compare(answer, reference.greedy(prompt, tokens)))
    finally:
        reference.close()
    figures = summarise(rows)
    noise = figures["max_logit_diff"]
    listed = [
        {
            "prompt": p,
            **r.as_dict(),
            "near_tie": r.reference_gap is not None and r.reference_gap < 2 * noise,
        }
        for p, r in zip(PROMPTS, rows)
        if not r.equal
    ]
    return {"prompt_ids_equal": ids_equal, **figures, "partings": listed}


def _seamline_answers(gguf: Path, precision: str, tokens: int) -> list[tuple[list[int], Answer]]:
    """Each prompt's ids and greedy answer, in this process at ``precision``."""
    from seamline.app import LocalModel
    from seamline.params import SamplingParams

    model = LocalModel.load(gguf, precision=precision, speculative="off")
    codec = model.codec
    params = SamplingParams(
        temperature=0, max_tokens=tokens, logprobs=5, stop_token_ids=codec.stop_ids
    )
    answers = []
    for prompt in PROMPTS:
        ids = codec.encode_prompt(prompt)
        events = list(model.engine.events(ids, params))
        answer = Answer([e.token for e in events], [dict(e.top) for e in events])
        answers.append((ids, answer))
    return answers
