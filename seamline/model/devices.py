"""Where a process computes: ``--device auto|cpu|cuda|cuda:N|mps``.

A stage's weights, KV caches, activations and greedy draws live on its device; a step's input
(token ids or a hidden frame) crosses to it once and its output (a hidden frame, or logits
for the draw) back to the host once, through a pinned buffer (``to_host``). A node whose GPU
holds only its first layers keeps the rest on the CPU (``place_stage``'s ``gpu_layers``): the
hidden state then crosses once more, between the two, at that layer.
"""

from __future__ import annotations

import copy
import logging
import threading

import torch
from torch import nn

from seamline.errors import ConfigError

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"
log = logging.getLogger(__name__)


def resolve_device(name: str | None) -> torch.device:
    """The device ``--device name`` means here; a device this machine lacks is a ConfigError."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a device (choose {DEVICE_CHOICES})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        return _cuda(device, name)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(
                "--device mps: this torch sees no Apple GPU (mps needs macOS on Apple silicon)"
            )
        return device
    raise ConfigError(f"--device {name}: seamline runs on {DEVICE_CHOICES}")


def _cuda(device: torch.device, name: str) -> torch.device:
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "the CPU build"
        raise ConfigError(
            f"--device {name}: torch sees no CUDA device (torch {torch.__version__}, {build}; "
            "install.sh installs the CUDA build where nvidia-smi finds a driver)"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def describe(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200, 139.8 GiB)`` or ``cpu``."""
    if device.type != "cuda":
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def free_bytes(device: torch.device) -> int | None:
    """Memory free on an accelerator now (None on the CPU: the system's memory counts there)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def is_accelerator(device: torch.device) -> bool:
    return device.type in ("cuda", "mps")


def _is_weight(value: object) -> bool:
    """A tensor, or a weight ``nn.Module.to`` does not see (quantized, scaled, a concatenation, a window)."""
    from seamline.model.linear import ColumnWindow, RowConcat
    from seamline.quant.scaled import ScaledTensor
    from seamline.quant.tensor import QuantTensor

    return isinstance(value, (torch.Tensor, QuantTensor, ScaledTensor, RowConcat, ColumnWindow))


def _moved(value: object, device: torch.device) -> object:
    """``value`` on ``device`` when it is a weight attribute (a parameter is ``nn.Module.to``'s),
    else None."""
    from seamline.model.linear import to_device

    if not _is_weight(value) or isinstance(value, nn.Parameter):
        return None
    return value.to(device) if isinstance(value, torch.Tensor) else to_device(value, device)  # type: ignore[arg-type]


def move_module(module: nn.Module, device: torch.device) -> None:
    """Every parameter, buffer, weight attribute and rotary table of ``module`` onto ``device``,
    in place. Raises ConfigError naming the device and the sizes when it does not fit."""
    try:
        module.to(device)
        done: dict[int, object] = {}  # one copy of a weight two attributes share (a tied head)
        originals: list[
            object
        ] = []  # kept alive through the walk, so that no id in ``done`` is reused
        for sub in module.modules():
            for name, value in list(vars(sub).items()):
                if name.startswith("_") or value is None:
                    continue
                if id(value) in done:
                    if done[id(value)] is not value:
                        setattr(sub, name, done[id(value)])
                    continue
                moved = _moved(value, device)
                if moved is not None:
                    setattr(sub, name, moved)
                    done[id(value)] = done[id(moved)] = moved
                    originals.append(value)
                elif hasattr(
                    value, "move_to"
                ):  # a rotary table: one copy per device for the blocks sharing it
                    table = copy.copy(value)
                    table.move_to(device)
                    setattr(sub, name, table)
                    done[id(value)] = done[id(table)] = table
                    originals.append(value)
    except torch.OutOfMemoryError as exc:
        raise ConfigError(out_of_memory_line(device, module_bytes(module), str(exc))) from None


def module_bytes(module: nn.Module) -> int:
    """The resident bytes of a module's weights (quantized ones at their size)."""
    from seamline.model.linear import weight_bytes

    seen: set[int] = set()
    total = 0
    for sub in module.modules():
        for value in [*sub._parameters.values(), *vars(sub).values()]:
            if not _is_weight(value) or id(value) in seen:
                continue
            seen.add(id(value))
            total += weight_bytes(value)  # type: ignore[arg-type]
    return total


def out_of_memory_line(device: torch.device, wanted: int, detail: str = "") -> str:
    free = free_bytes(device)
    have = f", {free / 2**30:.2f} GiB free" if free is not None else ""
    first = detail.splitlines()[0] if detail else "out of memory"
    return f"{describe(device)}: {wanted / 2**30:.2f} GiB of weights do not fit{have} ({first})"


def concrete_device(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` is this process's current GPU): two ranks on one host
    tell from it whether they share a GPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def place_stage(stage: nn.Module, device: torch.device, gpu_layers: int | None = None) -> None:
    """Put ``stage`` on ``device``; with ``gpu_layers`` N and an accelerator, only its first N
    layers (and the embedding when it owns it, unless the head shares it) go there, the rest
    (and the head) stay on the CPU."""
    layers: dict[str, nn.Module] = getattr(stage, "layers", {})  # type: ignore[assignment]
    tied = getattr(stage, "head", None) is not None and stage.head is getattr(stage, "embed", None)
    if device.type == "cpu" or gpu_layers is None or gpu_layers >= len(layers):
        move_module(stage, device)
        if tied:  # a conversion may have made the two registrations two tables
            stage.head = stage.embed
        return
    for index, block in enumerate(layers.values()):
        if index < gpu_layers:
            move_module(block, device)
    embed = getattr(stage, "embed", None)
    if (
        embed is not None and gpu_layers > 0 and not tied
    ):  # a tied table stays with the head, on the CPU
        stage.embed = _to_device_weight(embed, device)
    log.info(
        "%d of %d layers on %s, the rest on the cpu", gpu_layers, len(layers), describe(device)
    )


def _to_device_weight(weight: object, device: torch.device) -> object:
    """A weight (a float parameter included) on ``device``."""
    if isinstance(weight, nn.Parameter):
        return nn.Parameter(weight.data.to(device), requires_grad=False)
    return _moved(weight, device)


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter (its norm's, for a block)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


_PINNED = threading.local()  # per thread: a node's two stage workers never share a buffer


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A page-locked host buffer of ``tensor``'s shape and dtype, reused by this thread: a copy
    from or to it runs at the link's full rate, where pageable memory is staged by the driver."""
    buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = _PINNED.__dict__.setdefault(
        "buffers", {}
    )
    key = (tuple(tensor.shape), tensor.dtype)
    buffer = buffers.get(key)
    if buffer is None:
        if len(buffers) > 64:  # shapes vary with the batch: keep a bounded few
            buffers.clear()
        buffer = buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return buffer


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU: from CUDA through a pinned buffer (copied out, so the caller may
    keep it while the buffer serves the next step)."""
    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type != "cuda":
        return tensor.cpu()
    buffer = _pinned(tensor)
    buffer.copy_(tensor)
    return buffer.clone()


def from_host(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A step's input (token ids, a hidden frame) onto ``device``, from a pinned buffer on CUDA
    (``linear.to_device`` moves weights)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu" and tensor.numel() > 4096:
        buffer = _pinned(tensor)
        buffer.copy_(tensor)
        return buffer.to(device)
    return tensor.to(device)
