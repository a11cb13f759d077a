"""llama.cpp's own files the tests hold seamline to (``seamline_bench.references``)."""

from seamline_bench.references import GEMMA_BYTES, gemma3_270m, gguf_py_path, llama_cpp_source

__all__ = ["GEMMA_BYTES", "gemma3_270m", "gguf_py_path", "llama_cpp_source"]
