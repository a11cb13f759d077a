"""`seamline bench quant`'s measurement of one model, end to end on the embedded model.

Rates on a shared machine say little; what must hold: every party measured in its own
process, the JSON fields present and consistent, llama.cpp either measured or reported null
with how to install it, and the resident weights within 1.25x of the GGUF tensor bytes.
"""

from __future__ import annotations

import importlib.util

from seamline.app import default_model_path
from seamline.bench.quant import PARTIES, _bench_model
from seamline.text import TextCodec

FIELDS = ("seamline_tok_s", "dequant_tok_s", "llamacpp_tok_s", "ratio", "prefill_tok_s", "activation_dtype",
          "resident_weight_bytes", "gguf_tensor_bytes", "memory_ratio", "seamline_exact_tok_s")  # fmt: skip


def test_bench_quant_measures_every_party_on_the_embedded_model() -> None:
    prompt = TextCodec.from_model(default_model_path(), ()).encode_chat([{"role": "user", "content": "Hi"}])
    result = _bench_model(default_model_path(), prompt, repeats=1, tokens=2, threads=1)
    for key in FIELDS:
        assert key in result, key
    assert result["seamline_tok_s"] > 0 and result["dequant_tok_s"] > 0 and result["seamline_exact_tok_s"] > 0
    assert result["prefill_tok_s"]["seamline"] > 0 and result["prefill_tok_s"]["dequant"] > 0
    assert result["gguf_tensor_bytes"] == 96576768  # the embedded file's tensors (Q4_1, Q8_0, F32)
    assert result["memory_ratio"] == round(result["resident_weight_bytes"] / result["gguf_tensor_bytes"], 3)
    assert result["memory_ratio"] <= 1.25
    llamacpp = importlib.util.find_spec("llama_cpp") is not None
    assert (result["llamacpp_tok_s"] is not None) == llamacpp
    assert llamacpp or "pip install llama-cpp-python" in result["llamacpp_note"]
    assert all(len(result["runs"][p]) == (1 if p != "llamacpp" or llamacpp else 0) for p in PARTIES)
