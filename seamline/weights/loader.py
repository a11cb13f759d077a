"""Fill a Stage from a TensorSource, reading only the tensors its ownership names.

Every load proves the checkpoint is complete and consistent: a tensor the model needs and
the checkpoint lacks, a tensor the checkpoint has and no model of this config would read,
a wrong shape or a non-float dtype each raise a CheckpointError naming the tensor.

Quantized weights (``QuantTensor``) stay quantized: fused parts of one quant type become one
QuantTensor, parts of mixed types a ``RowConcat``. Two kinds are made float at load: the
MoE router and its bias (float32: routing decisions), MLA's ``kv_b`` (small, and the absorbed
attention reads it per head). A lockstep rank's column share that cuts quant blocks (an
attention output projection split by heads) keeps the whole blocks around it as a
``ColumnWindow`` (exact; logged once per type).
A float matrix narrower than ``dtype`` (a bfloat16 checkpoint under float32) keeps its dtype.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from seamline.config import ModelConfig
from seamline.errors import CheckpointError
from seamline.model.devices import place_stage
from seamline.model.linear import ColumnWindow, RowConcat, Weight, columns, rows, to_float
from seamline.model.stage import Stage
from seamline.ownership import Ownership, Range
from seamline.parallel.comm import Comm
from seamline.quant.native import kernels
from seamline.quant.scaled import ScaledTensor, concat_scaled_rows, stack_scaled
from seamline.quant.tensor import QuantTensor, concat_rows, stack
from seamline.weights.names import TensorPlan, ignorable, mtp_plans, stage_plans
from seamline.weights.source import TensorSource

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP32_SUFFIXES = (
    ".router",
    ".router_bias",
    ".router_logit_bias",
)  # routing decisions stay in full precision
FLOAT_SUFFIXES = FP32_SUFFIXES + (".attn.kv_b",)  # dequantised at load (see the docstring)
INTEGER_SUFFIXES = (".ffn.table",)
CACHE_LINE = 64  # bytes: where a matrix the kernels read should start  # DeepSeek-V4's token id -> experts tables
log = logging.getLogger(__name__)
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}  # --dtype names


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
    mtp: bool = False,
    device: torch.device | None = None,
    gpu_layers: int | None = None,
) -> Stage:
    """Build the Stage this ownership describes and fill every parameter from ``source``
    (``mtp``: and the multi-token-prediction layer, which drafts; ``mtp_missing`` first), then
    put it on ``device`` (``devices.place_stage``: ``gpu_layers`` of it on an accelerator)."""
    stage = fill_stage(source, own, dtype, config, comm, mtp)
    settle_stage(stage, device, gpu_layers)
    return stage


def fill_stage(
    source: TensorSource,
    own: Ownership | None = None,
    dtype: torch.dtype = torch.float32,
    config: ModelConfig | None = None,
    comm: Comm | None = None,
    mtp: bool = False,
) -> Stage:
    """``load_stage``'s stage, filled in host memory and not yet placed (``settle_stage``)."""
    config = config or ModelConfig.from_hf_dict(source.config_dict())
    own = own or Ownership.full(config)
    check_names(source, config)
    if mtp and (why := mtp_missing(source, config, embed=not own.owns_embedding())):
        raise CheckpointError(f"--speculative mtp: {why}")
    stage = build_stage(config, own, comm, mtp)
    params = dict(stage.named_parameters(remove_duplicate=False))
    plans = stage_plans(config, own, mtp)
    unfilled = set(params) - {p.target for p in plans}
    if unfilled:
        raise CheckpointError(f"no checkpoint table entry for parameter {sorted(unfilled)[0]}")
    tied = stage.head is not None and stage.head is stage.embed
    for plan in plans:
        target = params[plan.target]
        if plan.target == "head" and tied:
            continue  # tied embeddings: the head is the embedding, filled as "embed"
        value = _assemble(source, plan, tuple(target.shape[2 if plan.stack else 1 :]))
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor {plan.sources()[0]} gives {plan.target} shape {tuple(value.shape)}, "
                f"the config needs {tuple(target.shape)}"
            )
        _assign(stage, plan.target, _resident(plan.target, value, dtype))
    if tied:
        _assign(stage, "head", stage.embed)
    return stage


def settle_stage(
    stage: Stage, device: torch.device | None = None, gpu_layers: int | None = None
) -> None:
    """Put a filled stage on ``device``, and make ready the CPU's quant kernels where a CPU
    part of it needs them (built once per machine: now, not in the first request)."""
    if device is not None:
        place_stage(stage, device, gpu_layers)
    on_cpu = device is None or device.type == "cpu" or gpu_layers is not None
    if on_cpu and any(
        isinstance(w, (QuantTensor, RowConcat, ColumnWindow))
        for m in stage.modules()
        for w in vars(m).values()
    ):
        kernels()


def mtp_missing(source: TensorSource, config: ModelConfig, embed: bool = False) -> str | None:
    """Why the checkpoint has no multi-token-prediction layer to draft with (None: it has one;
    ``embed``: with its own copy of the embedding, which a pipeline's last stage reads)."""
    if not config.mtp_layers:
        return f"the {config.family} checkpoint has no multi-token-prediction layer (num_nextn_predict_layers)"
    names = source.names()
    missing = [
        n
        for p in mtp_plans(config, Ownership.full(config), embed)
        for n in p.sources()
        if n not in names
    ]
    return (
        f"the checkpoint lacks tensor {missing[0]} of its multi-token-prediction layer"
        if missing
        else None
    )


def build_stage(
    config: ModelConfig, own: Ownership, comm: Comm | None = None, mtp: bool = False
) -> Stage:
    """The empty Stage of this family (every parameter a placeholder until loaded)."""
    if config.is_v4:
        from seamline.model.v4_stage import V4Stage

        return V4Stage(config, own, comm, mtp)  # type: ignore[return-value]  # a Stage in all the runtime uses
    return Stage(config, own, comm, mtp)


def _resident(target: str, value: Weight, dtype: torch.dtype) -> Weight:
    """The form a loaded weight is kept in (see the module docstring), aligned."""
    if target.endswith(INTEGER_SUFFIXES):
        return value
    if target.endswith(FP32_SUFFIXES):
        return aligned(to_float(value, torch.float32).contiguous())
    if not isinstance(value, torch.Tensor):
        return aligned(
            to_float(value, dtype).contiguous() if target.endswith(FLOAT_SUFFIXES) else value
        )
    narrower = value.dim() >= 2 and value.element_size() < dtype.itemsize
    return aligned(value.contiguous() if narrower else value.to(dtype).contiguous())


def aligned(weight: Weight) -> Weight:
    """``weight`` with every tensor of it on a cache line: a view into a safetensors file
    sits wherever the file's header left it, and the matrix kernels read a misaligned
    matrix ~20% slower (a DeepSeek-V4 stage from fragments: 165 -> 130 ms a token).
    Misaligned tensors are copied into this process's memory; the rest are kept as they are."""
    if isinstance(weight, torch.Tensor):
        return weight.clone() if weight.data_ptr() % CACHE_LINE else weight
    for slot in (
        "data",
        "values",
        "scales",
    ):  # QuantTensor's blocks, ScaledTensor's values and scales
        part = getattr(weight, slot, None)
        if isinstance(part, torch.Tensor) and part.data_ptr() % CACHE_LINE:
            setattr(weight, slot, part.clone())
    return weight


def _assign(stage: Stage, target: str, value: Weight) -> None:
    """Put ``value`` where parameter ``target`` is; a quantized weight replaces the parameter."""
    owner, _, attr = target.rpartition(".")
    module = stage.get_submodule(owner)
    module._parameters.pop(attr, None)
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        value = nn.Parameter(value, requires_grad=False)
    setattr(module, attr, value)


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
        parts.append(_concat(pieces))
    return _stack(parts) if plan.stack else parts[0]


def _concat(pieces: list[Weight]) -> Weight:
    """Rows side by side: one tensor when the pieces share a kind and quant type."""
    if len(pieces) == 1:
        return pieces[0]
    if all(isinstance(p, torch.Tensor) for p in pieces):
        dtypes = {p.dtype for p in pieces}  # type: ignore[union-attr]
        if len(dtypes) == 1:
            return torch.cat(pieces, dim=0)  # type: ignore[arg-type]
    if all(isinstance(p, QuantTensor) for p in pieces) and len({p.qtype for p in pieces}) == 1:  # type: ignore[union-attr]
        return concat_rows(pieces)  # type: ignore[arg-type]
    if (
        all(isinstance(p, ScaledTensor) for p in pieces)
        and len({(p.kind, p.block) for p in pieces}) == 1
    ):  # type: ignore[union-attr]
        return concat_scaled_rows(pieces)  # type: ignore[arg-type]
    return RowConcat(pieces)


def _stack(parts: list[Weight]) -> Weight:
    """Experts on a new dim 0; experts made of mixed-type parts stack part by part."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(parts)  # type: ignore[arg-type]
    if isinstance(first, QuantTensor):
        return stack(parts)  # type: ignore[arg-type]
    if isinstance(first, ScaledTensor):
        return stack_scaled(parts)  # type: ignore[arg-type]
    return RowConcat([_stack([p.parts[i] for p in parts]) for i in range(len(first.parts))])  # type: ignore[union-attr]


def _read(source: TensorSource, name: str, plan: TensorPlan, span: Range | None) -> Weight:
    tensor = source.get(name)
    if plan.target.endswith(INTEGER_SUFFIXES):
        return _integer(name, tensor)
    if isinstance(tensor, torch.Tensor) and tensor.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}, expected a float type")
    if (
        isinstance(tensor, (QuantTensor, ScaledTensor))
        and (bad := tensor.first_bad_block()) is not None
    ):
        kind = tensor.qtype.name if isinstance(tensor, QuantTensor) else tensor.kind
        raise CheckpointError(
            f"tensor {name} ({kind}) is corrupt: block {bad} has an infinite or NaN scale"
        )
    if span is None:
        return tensor
    start, end = span
    if tensor.dim() <= plan.slice_dim or tensor.shape[plan.slice_dim] < end:
        raise CheckpointError(
            f"tensor {name} shape {tuple(tensor.shape)} has no rows [{start},{end}) "
            f"on dim {plan.slice_dim}"
        )
    if plan.slice_dim == 0:
        return rows(tensor, start, end) if tensor.dim() >= 2 else tensor[start:end]
    if isinstance(tensor, ScaledTensor) and not tensor.column_aligned(start, end):
        raise CheckpointError(
            f"this rank's columns [{start},{end}) of {name} cut its {tensor.block[1]}-wide "
            f"{tensor.kind} blocks"
        )
    if isinstance(tensor, QuantTensor) and not tensor.column_aligned(start, end):
        _warn_window(name, tensor)
        return ColumnWindow.around(tensor, start, end)
    return columns(tensor, start, end)


def _integer(name: str, tensor: Weight) -> torch.Tensor:
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.is_floating_point()
        or tensor.dtype == torch.bool
    ):
        raise CheckpointError(
            f"tensor {name} has dtype {getattr(tensor, 'dtype', 'quantized')}, expected integers"
        )
    return tensor.long()


_warned: set[str] = set()


def _warn_window(name: str, tensor: QuantTensor) -> None:
    """Once per quant type: this rank's column share cuts the type's blocks."""
    if tensor.qtype.name not in _warned:
        _warned.add(tensor.qtype.name)
        log.warning(
            "this rank's columns of %s (%s) cut its %d-wide blocks: such shares keep the "
            "whole blocks around them (at most two more a row) and zero the inputs outside",
            name,
            tensor.qtype.name,
            tensor.block_size,
        )
