"""`seamline bench throughput`'s parts: prompts, which servers run with which flags, a real wave
of streaming clients against a real `seamline serve --single` and the engine's own rate on the
same prompt, and the summary's ratios and targets. (The full benchmark is run by hand; it takes
about half an hour and writes its JSON.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from seamline.app import default_model_path
from seamline.precision import int8_kernels_here
from seamline.text import TextCodec
from seamline_bench import throughput
from seamline_bench.load import _events, make_prompts, run_wave
from seamline_bench.servers import Server, start_single
from seamline_bench.throughput import (
    engine_decode_rate,
    plan_parties,
    prompts_file,
    seamline_env,
    wave,
)
from seamline_bench.throughput_result import TARGETS, result


def test_prompts_are_distinct_and_span_the_lengths() -> None:
    codec = TextCodec.from_model(default_model_path(), ())
    prompts = make_prompts(5, 32, 256, 3, codec.encode)
    lengths = [len(codec.encode(p)) for p in prompts]
    assert len(set(prompts)) == 5
    assert lengths == sorted(lengths) and 28 <= lengths[0] <= 32 and 250 <= lengths[-1] <= 256, (
        lengths
    )
    assert make_prompts(5, 32, 256, 4, codec.encode) != prompts  # another round: other prompts


def test_seamline_servers_run_without_seamline_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAMLINE_QUANT_ACTIVATIONS", "exact")
    monkeypatch.setenv("SEAMLINE_CACHE", "/tmp/kept")
    env = seamline_env()
    assert "SEAMLINE_QUANT_ACTIVATIONS" not in env and env["SEAMLINE_CACHE"] == "/tmp/kept"
    assert not [k for k in env if k.startswith("SEAMLINE_") and k != "SEAMLINE_CACHE"]


def test_parties_their_flags_and_client_counts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started: list[tuple[str, dict[str, Any]]] = []

    def record(kind: str) -> Any:
        def start(name: str, *args: Any, **kwargs: Any) -> Server:
            started.append((kind, {"name": name, "args": args, **kwargs}))
            return Server(name, "http://x/v1", "m", [])

        return start

    for kind in ("start_single", "start_mesh", "start_llama"):
        monkeypatch.setattr(throughput, kind, record(kind))
    ggufs = {"embedded": Path("e.gguf"), "llama_1b": Path("b.gguf")}
    parties, missing = plan_parties(
        ggufs, Path("llama-server"), "", tmp_path, (1, 4, 16, 64), (1, 16), 128
    )
    served = {(p.model, p.name): p.clients for p in parties}
    assert (
        served
        == {
            ("embedded", "seamline"): (1, 4, 16, 64),
            ("embedded", "mesh_2_stages"): (1,),
            ("embedded", "llamacpp_16"): (1, 4, 16),
            ("embedded", "llamacpp_64"): (64,),
            ("llama_1b", "seamline"): (1, 16),
            ("llama_1b", "seamline_exact"): (1, 16),
            ("llama_1b", "llamacpp_16"): (1, 16),
        }
        and missing == {}
    )
    for party in parties:
        party.start()
    flags = {s[1]["name"]: s[1].get("precision", "-") for s in started if s[0] != "start_llama"}
    assert flags == {
        "embedded-seamline": None,
        "embedded-mesh_2_stages": None,
        "llama_1b-seamline": None,
        "llama_1b-seamline_exact": "exact",
    }
    models = {s[1]["name"]: s[1].get("model") for s in started if s[0] == "start_single"}
    assert models["embedded-seamline"] == Path("e.gguf") and models[
        "llama_1b-seamline_exact"
    ] == Path("b.gguf")
    llamas = [s[1] for s in started if s[0] == "start_llama"]
    slots = {
        s["name"]: (s["args"][1], s["args"][3], s["args"][4]) for s in llamas
    }  # gguf, --parallel, slot length
    assert slots == {
        "embedded-llamacpp_16": (Path("e.gguf"), 16, 448),
        "embedded-llamacpp_64": (Path("e.gguf"), 64, 448),
        "llama_1b-llamacpp_16": (Path("b.gguf"), 16, 448),
    }
    _, missing = plan_parties(ggufs, None, "no cmake", tmp_path, (1, 64), (1,), 128)
    assert missing == {
        "embedded.llamacpp_16": "no cmake",
        "embedded.llamacpp_64": "no cmake",
        "llama_1b.llamacpp_16": "no cmake",
    }


def test_a_wave_of_streaming_clients_through_the_api(tmp_path: Path) -> None:
    server = start_single("one_node", 2, seamline_env(), tmp_path, precision=None)
    try:
        server.wait_healthy(timeout_s=300)
        done = wave(server, prompts_file(3, 1, tmp_path), 5)
        refused = asyncio.run(
            run_wave(server.url, "no-such-model", ["a", "b"], 5)
        )  # the server's 404, counted
    finally:
        server.close()
    assert done["clients"] == 3 and done["failed"] == 0
    assert done["tokens"] == 15  # ignore_eos: every stream makes all 5 tokens
    assert len(done["ttft_ms"]) == 3 and all(t > 0 for t in done["ttft_ms"])
    assert (
        len(done["itl_ms"]) >= 3 * 3 and done["tok_s"] > 0
    )  # chunks may carry more than one token
    assert len(done["decode_tok_s"]) == 3 and all(r > 0 for r in done["decode_tok_s"])
    assert (
        refused["failed"] == 2 and refused["tokens"] == 0 and "HTTP 404" in refused["errors"][0]
    ), refused
    said = (tmp_path / "one_node.log").read_text()
    blocks = (
        ", int8 blocks in the matmuls" if int8_kernels_here() else ""
    )  # a CPU without VNNI: bfloat16
    assert f"precision fast (bfloat16 activations{blocks})" in said, said[-2000:]


class _Pieces(httpx.AsyncByteStream):
    """A response body that arrives in the given pieces (a network splits events anywhere)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


def test_the_load_generator_reads_events_split_anywhere() -> None:
    events = [
        {"choices": [{"text": "a"}]},
        {"choices": [{"text": "b"}], "usage": None},
        {"usage": {"completion_tokens": 2}},
    ]
    body = (
        b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events)
        + b": ping\n\ndata: [DONE]\n\n"
    )
    body += b"data: {not json after the end}\n\n"
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]

    async def read() -> list[dict[str, Any]]:
        return [event async for event in _events(httpx.Response(200, stream=_Pieces(pieces)))]

    assert asyncio.run(read()) == events


def test_the_exact_party_names_its_precision(tmp_path: Path) -> None:
    server = start_single("exact", 2, seamline_env(), tmp_path, precision="exact")
    try:
        server.wait_healthy(timeout_s=300)
        done = wave(server, prompts_file(1, 2, tmp_path), 2)
    finally:
        server.close()
    assert done["tokens"] == 2 and done["failed"] == 0
    said = (tmp_path / "exact.log").read_text()
    assert "precision exact (float32 activations)" in said, said[-2000:]


def test_the_engine_decodes_the_prompt_alone() -> None:
    assert engine_decode_rate(default_model_path(), "Note 1-0: river stone light", 3) > 0


def _wave(tok_s: float, decode: float | None = None) -> dict[str, Any]:
    return {
        "tok_s": tok_s,
        "ttft_ms": [10.0, 30.0],
        "itl_ms": [5.0, 7.0, 9.0],
        "decode_tok_s": [] if decode is None else [decode],
    }


def test_summary_ratios_and_targets() -> None:
    runs = {
        "embedded": {
            "seamline": {
                1: [_wave(100, 90), _wave(120, 100), _wave(110, 95)],
                16: [_wave(600)],
                64: [_wave(900)],
            },
            "mesh_2_stages": {1: [_wave(99)]},
            "llamacpp_16": {1: [_wave(125)], 16: [_wave(300)]},
            "llamacpp_64": {64: [_wave(450)]},
        },
        "llama_1b": {
            "seamline": {1: [_wave(20)], 16: [_wave(50)]},
            "seamline_exact": {1: [_wave(10)], 16: [_wave(25)]},
            "llamacpp_16": {1: [_wave(21)], 16: [_wave(40)]},
        },
    }
    out = result(runs, [100.0, 125.0, 95.0], {}, 128, 3, [32, 256], {"version": "x"}, "logs")
    small, big = out["models"]["embedded"], out["models"]["llama_1b"]
    assert (
        small["vs_llamacpp_1"] == 0.88
        and small["vs_llamacpp_16"] == 2.0
        and small["vs_llamacpp_64"] == 2.0
    )
    assert small["batch_gain_16"] == 5.455  # 600 / median(100, 120, 110)
    assert big["vs_llamacpp_1"] == 0.952 and big["vs_llamacpp_16"] == 1.25
    assert out["exact_batch_gain_16"] == 2.5 and out["mesh_single_ratio"] == 0.9
    assert out["single_stream_ratio"] == 0.9  # median of 90/100, 100/125, 95/95
    assert out["engine_decode_tok_s"] == 100.0 and out["api_decode_tok_s"] == 95.0
    assert out["targets"] == TARGETS
    assert out["targets_met"] == {
        "embedded.vs_llamacpp_1": True,
        "llama_1b.vs_llamacpp_1": True,
        "embedded.vs_llamacpp_16": True,
        "llama_1b.vs_llamacpp_16": False,
        "single_stream_ratio": True,
        "exact_batch_gain_16": False,
        "mesh_single_ratio": True,
    }
    cell = small["configs"]["seamline"]["1"]
    assert cell["tok_s"] == 110 and cell["ttft_p50_ms"] == 30.0 and cell["itl_p95_ms"] == 9.0
    assert out["llama_cpp"] == {"version": "x"} and out["repeats"] == 3


def test_a_figure_not_measured_meets_no_target() -> None:
    out = result(
        {"embedded": {"seamline": {1: [_wave(100, 90)]}}},
        [],
        {"embedded.llamacpp_16": "no cmake"},
        4,
        1,
        [32, 256],
        {"unavailable": "no cmake"},
        "logs",
    )
    assert out["models"]["embedded"]["vs_llamacpp_1"] is None and out["single_stream_ratio"] is None
    assert set(out["targets_met"].values()) == {None}
