"""`seamline bench quant`'s measurement of one model, end to end on the embedded model, and the
llama.cpp build both it and `bench throughput` compare with.

Rates on a shared machine say little; what must hold: every party measured in its own
process, the JSON fields present and consistent, llama.cpp either measured (when its build is
cached: a test does not build it) or reported null with why, and the resident weights within
1.25x of the GGUF tensor bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from seamline.app import default_model_path
from seamline.cpu_flags import cpu_flags, isa_of
from seamline.text import TextCodec
from seamline_bench import llama_server
from seamline_bench.llama_server import (
    CMAKE_FLAGS,
    LlamaBuild,
    build_key,
    llama_cpp_build,
    server_command,
)
from seamline_bench.quant import PARTIES, TARGETS, _bench_model, targets_met

FIELDS = (
    "seamline_tok_s",
    "dequant_tok_s",
    "llamacpp_tok_s",
    "ratio",
    "prefill_tok_s",
    "activation_dtype",
    "resident_weight_bytes",
    "gguf_tensor_bytes",
    "memory_ratio",
    "seamline_exact_tok_s",
)
AT_ITS_BEST = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
)
AVX512 = (
    "-DGGML_AVX512=ON",
    "-DGGML_AVX512_VNNI=ON",
    "-DGGML_AVX512_BF16=ON",
    "-DGGML_AVX512_VBMI=ON",
)


def test_bench_quant_measures_every_party_on_the_embedded_model() -> None:
    prompt = TextCodec.from_model(default_model_path(), ()).encode_chat(
        [{"role": "user", "content": "Hi"}]
    )
    build, why = llama_cpp_build(build=False)
    result = _bench_model(
        default_model_path(), prompt, repeats=1, tokens=2, threads=1, build=build, why=why
    )
    for key in FIELDS:
        assert key in result, key
    assert (
        result["seamline_tok_s"] > 0
        and result["dequant_tok_s"] > 0
        and result["seamline_exact_tok_s"] > 0
    )
    assert result["prefill_tok_s"]["seamline"] > 0 and result["prefill_tok_s"]["dequant"] > 0
    assert result["gguf_tensor_bytes"] == 96576768  # the embedded file's tensors (Q4_1, Q8_0, F32)
    assert result["memory_ratio"] == round(
        result["resident_weight_bytes"] / result["gguf_tensor_bytes"], 3
    )
    assert result["memory_ratio"] <= 1.25
    assert (result["llamacpp_tok_s"] is not None) == (build is not None)
    assert build is not None or why in result["llamacpp_note"]
    assert build is None or result["llamacpp_tok_s"] > 0 and result["prefill_tok_s"]["llamacpp"] > 0
    assert all(len(result["runs"][p]) == (1 if p != "llamacpp" or build else 0) for p in PARTIES)


def test_quant_targets() -> None:
    assert TARGETS == {"embedded.ratio": 0.8, "llama_1b.ratio": 1.0}
    met = targets_met({"embedded.ratio": 0.81, "llama_1b.ratio": None}, TARGETS)
    assert met == {"embedded.ratio": True, "llama_1b.ratio": None}
    met = targets_met({"embedded.ratio": 0.79, "llama_1b.ratio": 1.0}, TARGETS)
    assert met == {"embedded.ratio": False, "llama_1b.ratio": True}


def test_llama_cpp_is_built_at_its_best_and_run_with_its_defaults() -> None:
    assert all(flag in CMAKE_FLAGS for flag in AT_ITS_BEST)
    on_avx512 = (
        isa_of(cpu_flags()) == "avx512"
    )  # AVX-512 only where the CPU runs it: else an illegal instruction
    assert all((flag in CMAKE_FLAGS) == on_avx512 for flag in AVX512), (on_avx512, CMAKE_FLAGS)
    assert "-DGGML_NATIVE=ON" not in CMAKE_FLAGS
    command = server_command(Path("llama-server"), Path("m.gguf"), 8080, 2, 16, 448)
    assert "--no-repack" not in command
    assert command[command.index("--parallel") + 1] == "16" and command[
        command.index("-c") + 1
    ] == str(16 * 448)


def test_a_build_with_other_flags_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = tuple(f.replace("GGML_NATIVE=OFF", "GGML_NATIVE=ON") for f in CMAKE_FLAGS)
    assert build_key(flags=native) != build_key() and build_key().startswith(
        llama_server.LLAMA_CPP_PYTHON
    )
    monkeypatch.delenv(llama_server.BIN_ENV, raising=False)
    monkeypatch.setenv("SEAMLINE_CACHE", str(tmp_path))
    old = tmp_path / "llama-cpp" / build_key(flags=native)
    old.mkdir(parents=True)
    for name in llama_server.TARGETS:  # llama-server, llama-bench, llama-quantize
        (old / name).write_text("")
    build, why = llama_cpp_build(build=False)
    assert build is None and "not built" in why
    fresh = tmp_path / "llama-cpp" / build_key()
    fresh.mkdir()
    for name in llama_server.TARGETS:
        (fresh / name).write_text("")
    build, _ = llama_cpp_build(build=False)
    assert build is not None and build.folder == fresh and build.cmake_flags == CMAKE_FLAGS
    assert "vendor/llama.cpp" in build.source


def test_the_json_names_the_build(tmp_path: Path) -> None:
    (tmp_path / "llama-server").write_text(
        "#!/bin/sh\necho 'version: 1 (abc)'; echo 'built with cc'\n"
    )
    (tmp_path / "llama-server").chmod(0o755)
    described = LlamaBuild(tmp_path, "src", CMAKE_FLAGS).describe()
    assert described == {
        "version": "version: 1 (abc); built with cc",
        "llama_server": str(tmp_path / "llama-server"),
        "llama_bench": str(tmp_path / "llama-bench"),
        "source": "src",
        "cmake_flags": list(CMAKE_FLAGS),
    }
