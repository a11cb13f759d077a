"""A Hugging Face folder's bfloat16 matrices stay bfloat16 under --dtype float32 (no 2x copy);
norms and activations take the requested dtype; the result equals float32 compute on the
same bfloat16 weights within bfloat16 rounding of the activations at each matmul."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from seamline.weights.loader import load_stage, open_source
from tests.support.reference import random_ids, save_random_model, seamline_logits


def test_bf16_matrices_stay_bf16(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = save_random_model(config, tmp_path / "fp32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    stage = load_stage(open_source(tmp_path / "bf16"), dtype=torch.float32)
    block = stage.layers["0"]
    assert block.attn.qkv.dtype == block.ffn.down.dtype == stage.embed.dtype == torch.bfloat16  # type: ignore[union-attr]
    assert block.input_norm.weight.dtype == torch.float32 and stage.compute_dtype == torch.float32
    ids = random_ids(256)
    ours = seamline_logits(stage, ids)
    assert ours.dtype == torch.float32
    widened = load_stage(open_source(tmp_path / "bf16"), dtype=torch.float32)
    for module in widened.modules():  # the same bf16 values held as float32
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.float(), requires_grad=False))
    reference = seamline_logits(widened, ids)
    err = (ours - reference).abs().max().item()
    assert 0 < err < 0.05 * reference.abs().max().item(), err  # > 0: the matmuls did run in bf16
