"""Fill a Stage from a TensorSource, reading only the tensors its ownership names.

Every load proves the checkpoint is complete and consistent: a tensor the model needs and
the checkpoint lacks, a tensor the checkpoint has and no model of this config would read,
a wrong shape or a non-float dtype each raise a CheckpointError naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from seamline.config import ModelConfig
from seamline.errors import CheckpointError
from seamline.model.ownership import Ownership, Range
from seamline.model.stage import Stage
from seamline.parallel.comm import Comm
from seamline.weights.names import TensorPlan, ignorable, stage_plans
from seamline.weights.source import TensorSource

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP32_SUFFIXES = (".router", ".router_bias")  # routing decisions stay in full precision
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype names


def dtype_bytes(name: str) -> int:
    """Bytes per element of a --dtype name."""
    return DTYPES[name].itemsize


def open_source(path: str | Path) -> TensorSource:
    """A Hugging Face folder or a .gguf file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from seamline.weights.gguf import GGUFSource

        return GGUFSource(path)
    if path.is_file():
        raise CheckpointError(f"{path} is neither a .gguf file nor a Hugging Face folder")
    if (path / "manifest.json").is_file():
        from seamline.weights.fragments import FragmentSource

        return FragmentSource(path)
    from seamline.weights.safetensors import HFFolderSource

    return HFFolderSource(path)


def check_names(source: TensorSource, config: ModelConfig) -> None:
    """Nothing missing, nothing unexpected, over the whole model."""
    expected = {n for p in stage_plans(config, Ownership.full(config)) for n in p.sources()}
    present = source.names()
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]} ({len(missing)} missing)")
    unexpected = sorted(n for n in present - expected if not ignorable(n, config))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected) "
            f"for model_type {config.family}"
        )


def load_stage(
    source: TensorSource,
    own: Ownership | None = None,
    dtype: torch.dtype = torch.float32,
    config: ModelConfig | None = None,
    comm: Comm | None = None,
) -> Stage:
    """Build the Stage this ownership describes and fill every parameter from ``source``."""
    config = config or ModelConfig.from_hf_dict(source.config_dict())
    own = own or Ownership.full(config)
    check_names(source, config)
    stage = Stage(config, own, comm)
    params = dict(stage.named_parameters(remove_duplicate=False))
    plans = stage_plans(config, own)
    unfilled = set(params) - {p.target for p in plans}
    if unfilled:
        raise CheckpointError(f"no checkpoint table entry for parameter {sorted(unfilled)[0]}")
    for plan in plans:
        target = params[plan.target]
        if plan.target == "head" and target is stage.embed:
            continue  # tied embeddings: the head is the embedding, already filled
        value = _assemble(source, plan, tuple(target.shape[2 if plan.stack else 1 :]))
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor {plan.sources()[0]} gives {plan.target} shape {tuple(value.shape)}, "
                f"the config needs {tuple(target.shape)}"
            )
        keep_fp32 = plan.target.endswith(FP32_SUFFIXES)
        target.data = value.to(torch.float32 if keep_fp32 else dtype).contiguous()
    return stage


def _assemble(source: TensorSource, plan: TensorPlan, trailing: tuple[int, ...]) -> torch.Tensor:
    """Read, slice and combine a plan's sources; each must end in the target's ``trailing`` dims."""
    parts = []
    for part in plan.parts:
        pieces = [_read(source, name, plan, plan.source_slice(j)) for j, name in enumerate(part)]
        for name, piece in zip(part, pieces):
            if tuple(piece.shape[1:]) != trailing:
                raise CheckpointError(
                    f"tensor {name} gives {plan.target} shape {tuple(piece.shape)}, "
                    f"the config needs trailing dims {trailing}"
                )
        parts.append(torch.cat(pieces, dim=0))
    return torch.stack(parts) if plan.stack else parts[0]


def _read(source: TensorSource, name: str, plan: TensorPlan, rows: Range | None) -> torch.Tensor:
    tensor = source.get(name)
    if tensor.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}, expected a float type")
    if rows is not None:
        start, end = rows
        if tensor.dim() <= plan.slice_dim or tensor.shape[plan.slice_dim] < end:
            raise CheckpointError(
                f"tensor {name} shape {tuple(tensor.shape)} has no rows [{start},{end}) "
                f"on dim {plan.slice_dim}"
            )
        tensor = tensor.narrow(plan.slice_dim, start, end - start)
    return tensor
