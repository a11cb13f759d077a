"""Helpers for GGUF tests: the float weights a GGUF file holds, and transformers run on them.

A quantised file's logits are compared with transformers run on the *dequantised* weights of
the same file (written back as a Hugging Face folder), so the comparison measures seamline,
not the quantisation error.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file

from seamline.weights.gguf import GGUFSource


def as_float(value: Any) -> torch.Tensor:
    """A GGUFSource tensor as float32: a float tensor as is, quantised blocks decoded."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32)
    raw = value.data.cpu().numpy()  # a QuantTensor: GGUF blocks and their logical shape
    values = np.array(dequantize(raw, value.qtype), dtype=np.float32)
    return torch.from_numpy(values).reshape(value.shape)


def dequantised_model(gguf_path: Path, config_folder: Path, out: Path) -> Any:
    """transformers' model of ``config_folder``'s config with the weights ``gguf_path`` holds."""
    from transformers import AutoModelForCausalLM

    source = GGUFSource(gguf_path)
    tensors = {name: as_float(source.get(name)).contiguous() for name in sorted(source.names())}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(config_folder / "config.json", out / "config.json")
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
