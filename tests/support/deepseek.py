"""DeepSeek test models built from configs, and their transformers references."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers  # the reference: a test dependency, never skipped

from seamline.model.stage import Stage

ATOL = 1e-4
PROMPT, DECODE = 32, 16
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)

YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    mscale=0.9,
    mscale_all_dim=0.7,
    original_max_position_embeddings=32,
    beta_fast=32.0,
    beta_slow=1.0,
)


# name -> (family, overrides of BASE)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v3": ("v3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    "v3_yarn": ("v3", dict(n_group=2, topk_group=1, rope_parameters=YARN)),
    "v3_halfsplit_rope": ("v3", dict(n_group=2, topk_group=1, rope_interleave=False)),
    "v2_lite_greedy": ("v2", dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy")),
    "v2_group_limited_yarn": (
        "v2",
        # one group of two: with max-scored groups, keeping 2 of 4 never binds at top-2
        dict(
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            rope_parameters=YARN,
        ),
    ),
    # Every layer dense: latent attention alone, independent of the router.
    "v3_dense": ("v3", dict(first_k_dense_replace=3, n_group=2, topk_group=1)),
    "v2_dense_lite": ("v2", dict(first_k_dense_replace=3, q_lora_rank=None)),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that a wrong formula shows; norms away from 1; a non-zero V3 bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.08 * noise)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))


def build_deepseek(
    tmp_path: Path, case: str, seed: int = 0, **changes: Any
) -> tuple[torch.nn.Module, Path]:
    """``changes``: config fields over the case's (a vocabulary a tokenizer reads, say)."""
    family, overrides = CASES[case]
    kwargs = {**BASE, **overrides, **changes}
    if family == "v3":
        config = transformers.DeepseekV3Config(**kwargs)
        model = transformers.DeepseekV3ForCausalLM(config)
    else:
        config = transformers.DeepseekV2Config(**kwargs)
        model = transformers.DeepseekV2ForCausalLM(config)
    randomize(model, seed)
    model.eval()
    folder = tmp_path / case
    model.save_pretrained(folder)
    return model, folder


def deepseek_tokens(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE["vocab_size"], (PROMPT + DECODE,), generator=gen)


def transformers_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0].float()  # [T, vocab]


def run_stages(
    stages: list[Stage], ids: torch.Tensor, chunks: tuple[int, ...] = (PROMPT,)
) -> torch.Tensor:
    """Prefill in ``chunks``, then decode the rest one token at a time, through the stages."""
    caches = [s.new_cache() for s in stages]
    bounds = [0]
    for c in chunks:
        bounds.append(bounds[-1] + c)
    bounds += list(range(bounds[-1] + 1, ids.shape[0] + 1))
    out = []
    for a, b in zip(bounds, bounds[1:]):
        x: torch.Tensor = ids[a:b]
        for stage, cache in zip(stages, caches):
            x = stage(x, a, cache)
        out.append(x)
    return torch.cat(out)  # [T, vocab]


def assert_close_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < ATOL, (
        f"max |seamline - transformers| = {err:.2e} >= {ATOL} (logit scale {want.abs().max():.2f})"
    )


def silence_outputs(model: torch.nn.Module) -> None:
    """Zero every attention output and feed-forward down projection: each layer then adds
    nothing, and the model's final state is the norm of its input's embedding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()


@dataclass
class MtpLayer:
    """A multi-token-prediction layer written into a checkpoint, for the reference: ``block`` a
    one-layer transformers model holding its block, ``shared_head.norm`` and the model's head;
    ``tensors`` its own (enorm, hnorm, eh_proj, ...; names without the layer prefix)."""

    block: torch.nn.Module
    tensors: dict[str, torch.Tensor]


def add_mtp_layer(
    model: torch.nn.Module, folder: Path, seed: int = 7, echo: bool = False
) -> MtpLayer:
    """Write a random multi-token-prediction layer (DeepSeek-V3's layer ``num_hidden_layers``:
    enorm, hnorm, eh_proj, a block, shared_head) into the checkpoint at ``folder``, and say so
    in its config, and return it (``MtpLayer``). With ``echo``
    (over a model whose layers add nothing: ``silence_outputs``) the layer computes what the
    model computes for the token after: its greedy drafts are right."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    settings = {**model.config.to_dict(), "num_hidden_layers": 1}
    settings["first_k_dense_replace"] = (
        0 if model.config.num_hidden_layers > model.config.first_k_dense_replace else 1
    )
    block = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**settings))
    randomize(block, seed)
    block.eval()
    with torch.no_grad():
        block.lm_head.weight.copy_(model.lm_head.weight)
        if echo:
            silence_outputs(block)
            block.model.norm.weight.copy_(model.model.norm.weight)
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed + 1)
    own = {
        "enorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
        "hnorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
        "eh_proj.weight": 0.08 * torch.randn(hidden, 2 * hidden, generator=gen),
        "shared_head.norm.weight": block.model.norm.weight.detach(),
        **(
            {"enorm.weight": torch.ones(hidden), "eh_proj.weight": torch.eye(hidden, 2 * hidden)}
            if echo
            else {}
        ),
        "shared_head.head.weight": model.lm_head.weight.detach(),
        "embed_tokens.weight": model.model.embed_tokens.weight.detach(),
    }
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    tensors = {prefix + name: t.clone().contiguous() for name, t in own.items()}
    block.save_pretrained(
        folder / "mtp-block"
    )  # the checkpoint's own spelling (one tensor per expert)
    for name, t in load_file(folder / "mtp-block" / "model.safetensors").items():
        if name.startswith("model.layers.0."):
            tensors[prefix + name.removeprefix("model.layers.0.")] = t.clone().contiguous()
    shutil.rmtree(folder / "mtp-block")
    save_file(tensors, folder / "model-mtp.safetensors")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return MtpLayer(block, own)


def mtp_reference_logits(
    model: torch.nn.Module, layer: MtpLayer, ids: torch.Tensor
) -> torch.Tensor:
    """The published formula in float64: row i [len(ids) - 1, vocab] drafts token i + 2 from
    the final state of position i (after the model's norm) and token i + 1, embedding first."""
    import copy

    main, mtp = copy.deepcopy(model).double(), copy.deepcopy(layer.block).double()
    for m in (main, mtp):  # the experts' grouped matmul takes no float64: the plain loop does
        m.config._experts_implementation = "eager"
    own = {name: t.double() for name, t in layer.tensors.items()}
    eps = model.config.rms_norm_eps

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    with torch.no_grad():
        states = main.model(ids[None]).last_hidden_state[0]  # after the model's norm
        embedded = main.model.embed_tokens(ids[1:])
        joined = torch.cat(
            [rms(embedded, own["enorm.weight"]), rms(states[:-1], own["hnorm.weight"])], dim=-1
        )
        return mtp(inputs_embeds=(joined @ own["eh_proj.weight"].T)[None]).logits[0]
