"""`seamline bench throughput`'s parts: prompts, a real wave of streaming clients against a real
`seamline serve --single`, and the summary's ratios. (The full benchmark is run by hand; it
takes tens of minutes and writes its JSON.)"""

from __future__ import annotations

import os
from pathlib import Path

from seamline.app import default_model_path
from seamline.bench.load import make_prompts
from seamline.bench.servers import start_single
from seamline.bench.throughput import _prompts, _result, _wave
from seamline.text import TextCodec


def test_prompts_are_distinct_and_span_the_lengths() -> None:
    codec = TextCodec.from_model(default_model_path(), ())
    prompts = make_prompts(5, 32, 256, 3, codec.encode)
    lengths = [len(codec.encode(p)) for p in prompts]
    assert len(set(prompts)) == 5
    assert lengths == sorted(lengths) and 28 <= lengths[0] <= 32 and 250 <= lengths[-1] <= 256, lengths
    assert make_prompts(5, 32, 256, 4, codec.encode) != prompts  # another round: other prompts


def test_a_wave_of_streaming_clients_through_the_api(tmp_path: Path) -> None:
    env = {**os.environ, "SEAMLINE_QUANT_ACTIVATIONS": "int8", "SEAMLINE_BENCH_DTYPE": "bfloat16"}
    server = start_single("one_node", 2, env, tmp_path)
    try:
        server.wait_healthy(timeout_s=300)
        wave = _wave(server, _prompts(3, 1, tmp_path), 5)
    finally:
        server.close()
    assert wave["clients"] == 3 and wave["failed"] == 0
    assert wave["tokens"] == 15  # ignore_eos: every stream makes all 5 tokens
    assert len(wave["ttft_ms"]) == 3 and all(t > 0 for t in wave["ttft_ms"])
    assert len(wave["itl_ms"]) >= 3 * 3 and wave["tok_s"] > 0  # chunks may carry more than one token


def test_summary_ratios(tmp_path: Path) -> None:
    def wave(tok_s: float) -> dict[str, object]:
        return {"tok_s": tok_s, "ttft_ms": [10.0, 30.0], "itl_ms": [5.0, 7.0, 9.0]}

    runs = {
        "one_node": {1: [wave(100), wave(120)], 16: [wave(600)]},
        "one_core": {64: [wave(300)]},
        "two_stages": {64: [wave(540)]},
        "llamacpp": {16: [wave(400)]},
    }
    result = _result(runs, [125.0], {"two_stages_lan": "needs root"}, 128, 2, tmp_path)  # type: ignore[arg-type]
    assert result["batch_gain_16"] == 5.455  # 600 / median(100, 120)
    assert result["vs_llamacpp_16"] == 1.5
    assert result["pipeline_gain_64"] == 1.8
    assert result["pipeline_gain_lan_64"] is None and result["not_measured"] == {"two_stages_lan": "needs root"}
    assert result["single_stream_ratio"] == 0.88
    cell = result["configs"]["one_node"]["1"]
    assert cell["ttft_p50_ms"] == 30.0 and cell["itl_p95_ms"] == 9.0
