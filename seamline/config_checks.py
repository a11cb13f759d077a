"""What a config.json may not say, refused in one line before anything runs: a field of another
family that this one would silently ignore (a dense Llama config with Mixtral's experts, a Qwen3
config with DeepSeek's latent attention), and a ``layer_types`` entry seamline does not know or
a list that does not cover the layers."""

from __future__ import annotations

from typing import Any

from seamline.errors import ConfigError

# a field -> the families that read it; set (not null, not zero) in any other family's config,
# nothing would read it and the model would run as another one
OWNED_FIELDS: dict[str, tuple[str, ...]] = {
    "num_local_experts": (
        "mixtral",
        "gpt_oss",
        "qwen3_moe",
    ),  # transformers 5 writes Qwen3-MoE's so
    "num_experts": ("qwen3_moe",),
    "n_routed_experts": ("deepseek_v2", "deepseek_v3", "deepseek_v4", "glm4_moe"),
    "kv_lora_rank": ("deepseek_v2", "deepseek_v3"),
}
CHECKED_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
    "glm4_moe",
    "gpt_oss",
)
LAYER_KINDS = ("sliding_attention", "full_attention")
READS_LAYER_TYPES = ("qwen2", "qwen3", "gemma3_text", "gpt_oss")


def check_fields(family: str, d: dict[str, Any]) -> None:
    """ConfigError naming the first field of another family that ``d`` sets, or a bad ``layer_types``."""
    if family in CHECKED_FAMILIES:
        for field, owners in OWNED_FIELDS.items():
            if d.get(field) and family not in owners:
                raise ConfigError(
                    f"config.json's model_type is {family!r} but it sets {field} = {d[field]!r}, "
                    f"a field of {' / '.join(owners)} that {family} does not read"
                )
    if family in READS_LAYER_TYPES and d.get("layer_types") is not None:
        check_layer_types(d["layer_types"], int(d.get("num_hidden_layers") or 0))


def check_layer_types(types: Any, layers: int) -> None:
    """Every layer named, each as a kind seamline computes."""
    if not isinstance(types, list) or len(types) < layers:
        count = len(types) if isinstance(types, list) else 0
        raise ConfigError(f"config.json's layer_types names {count} layers; the model has {layers}")
    for index, kind in enumerate(types[:layers]):
        if kind not in LAYER_KINDS:
            raise ConfigError(
                f"config.json's layer_types[{index}] is {kind!r}; seamline knows "
                f"{' and '.join(LAYER_KINDS)}"
            )
