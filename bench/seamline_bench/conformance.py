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

from seamline_bench.conformance_figures import file_figures
from seamline_bench.conformance_files import add_converter_files, files_only
from seamline_bench.conformance_vocab import vocab_vectors
from seamline_bench.llama_server import llama_cpp_build
from seamline_bench.references import gemma3_270m

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
                p: file_figures(build.server, path, p, PROMPTS, tokens, Path(tmp))
                for p in PRECISIONS
            }
    out["vocab"] = vocab_vectors()
    add_converter_files(out, build, PROMPTS, tokens)
    return out
