"""Shared helpers: build tiny random checkpoints with transformers and compare logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from seamline.model.stage import Stage
from seamline.ownership import Ownership
from seamline.weights.loader import load_stage, open_source

PREFILL = 32
DECODE = 16


def save_random_model(config: Any, folder: Path, seed: int = 0) -> Any:
    """A transformers model with random weights, saved as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at one; perturb them so a swapped norm is caught
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    return model


def reference_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits for every position of ids [T] (one full forward)."""
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0].float()


def seamline_logits(stage: Stage, ids: torch.Tensor, prefill: int = PREFILL) -> torch.Tensor:
    """seamline's logits over a prefill of ``prefill`` tokens, then one decode step per token."""
    cache = stage.new_cache()
    rows = [stage(ids[:prefill], 0, cache)]
    for pos in range(prefill, ids.shape[0]):
        rows.append(stage(ids[pos : pos + 1], pos, cache))
    return torch.cat(rows)


def split_logits(folder: Path, cut: int, ids: torch.Tensor) -> torch.Tensor:
    """Stage [0,cut) then Stage [cut,L), passing the residual stream between them."""
    source = open_source(folder)
    first = load_stage(source, Ownership(layers=(0, cut)))
    second = load_stage(source, Ownership(layers=(cut, first.config.num_layers)))
    c1, c2 = first.new_cache(), second.new_cache()
    rows = [second(first(ids[:PREFILL], 0, c1), 0, c2)]
    for pos in range(PREFILL, ids.shape[0]):
        rows.append(second(first(ids[pos : pos + 1], pos, c1), pos, c2))
    return torch.cat(rows)


def random_ids(vocab: int, count: int = PREFILL + DECODE, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))
