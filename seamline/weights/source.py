"""TensorSource: the one interface every checkpoint reader offers the loader.

Names are Hugging Face names (``model.layers.3.self_attn.q_proj.weight``); a reader of
another format (GGUF) translates its own names and layouts into these. ``get`` reads one
tensor lazily, so a process that owns part of a model never reads the rest.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from seamline.quant.tensor import QuantTensor


class TensorSource(Protocol):
    def names(self) -> set[str]:
        """Every tensor name in the checkpoint (Hugging Face naming)."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as stored, without reading its data."""
        ...

    def get(self, name: str) -> torch.Tensor | QuantTensor:
        """Read one tensor: floating point, or a QuantTensor of GGUF blocks."""
        ...

    def stored_type(self, name: str) -> str:
        """What ``get`` returns, without reading it: a torch dtype name or a quant type name."""
        ...

    def config_dict(self) -> dict[str, Any]:
        """The model's config as a Hugging Face config.json dict."""
        ...
