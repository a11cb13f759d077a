"""Which arithmetic a model runs in: ``--precision fast`` (the default) or ``exact``.

* ``fast``: quantized weights (GGUF blocks, DeepSeek's fp8/fp4) run with bfloat16 activations,
  and the GGUF matmuls round the activations to int8 blocks as llama.cpp does (VNNI integer
  dot products: about 2x the float kernels); float weights run in their own dtype (a bfloat16
  folder in bfloat16, a float32 or float16 one as stored).
* ``exact``: float32 activations, GGUF weights decoded as gguf-py decodes them: the answers of
  the dequantised float32 model, which tests against ``transformers`` compare with.

``--dtype`` overrides the activation dtype either way. The choice is made once per process
(``apply``), and in a mesh once by the coordinator for every stage and rank. A mesh that checks
its members (``--verify-fraction``) computes every row as it would alone (``rows_alone``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace

from seamline.errors import ConfigError

PRECISIONS = ("fast", "exact")
FLOAT_NAMES = ("float32", "bfloat16", "float16")  # --dtype names
log = logging.getLogger(__name__)
_SAID: set[str] = set()  # warnings given once per process


@dataclass(frozen=True)
class Precision:
    name: str  # "fast" | "exact"
    dtype: str  # activations: a --dtype name
    int8_activations: bool  # GGUF matmuls on int8 activation blocks
    # every int8 row on the fused kernel, whatever rows a step holds (``quant.matmul``): a row's
    # answer is its own, so a checked mesh's digests match its reference to the bit
    rows_alone: bool = False

    def describe(self) -> str:
        int8 = ", int8 blocks in the matmuls" if self.int8_activations else ""
        alone = ", every row computed as alone" if self.rows_alone else ""
        return f"{self.name} ({self.dtype} activations{int8}{alone})"

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "int8_activations": self.int8_activations,
            "label": label(self.dtype, self.int8_activations),
        }


def label(dtype: str, int8_activations: bool) -> str:
    """What a stage computes in, in a word: "bfloat16+int8" or "float32"."""
    return f"{dtype}+int8" if int8_activations else dtype


def weights_kind(stored_types: Iterable[str]) -> str:
    """ "quantized" when any weight is kept in blocks (GGUF, fp8, fp4), else the float dtype most
    tensors are stored in."""
    counts = Counter(stored_types)
    floats = {name: n for name, n in counts.items() if name in FLOAT_NAMES}
    if set(counts) - set(FLOAT_NAMES):
        return "quantized"
    return max(floats, key=lambda name: floats[name]) if floats else "float32"


def resolve(name: str, kind: str, dtype: str | None = None, accelerator: bool = False) -> Precision:
    """The precision ``name`` means for weights of ``kind`` (``weights_kind``), with ``dtype``
    (an explicit --dtype) for the activations when given; a bad name is a ConfigError. On an
    ``accelerator`` fast means bfloat16 activations without int8 blocks (a CPU kernel's trick)."""
    if name not in PRECISIONS:
        raise ConfigError(f"unknown precision {name!r}: choose {' or '.join(PRECISIONS)}")
    if dtype is not None and dtype not in FLOAT_NAMES:
        raise ConfigError(f"unknown dtype {dtype!r}: choose one of {', '.join(FLOAT_NAMES)}")
    if name == "exact":
        return Precision(name, dtype or "float32", False)
    quantized = kind == "quantized"
    chosen = dtype or ("bfloat16" if quantized else kind)
    return Precision(name, chosen, quantized and not accelerator and int8_kernels_here())


def checked(precision: Precision) -> Precision:
    """``precision`` for a mesh whose members are checked against the coordinator's copy: int8
    rows computed alone (the fused kernel at any step size), where it has int8 blocks."""
    return replace(precision, rows_alone=precision.int8_activations)


def int8_kernels_here() -> bool:
    """Whether this machine runs the int8-block kernels (x86-64 with AVX-512 VNNI and a compiler);
    says once when it does not."""
    from seamline.quant.native import kernels

    if kernels() is not None:
        return True
    once(
        "no-int8",
        "this CPU cannot run the int8-block kernels (they need x86-64 with AVX-512 VNNI and a "
        "C++ compiler): the fast precision multiplies in bfloat16 instead",
    )
    return False


def apply(precision: Precision) -> None:
    """Make this process's quantized matmuls follow ``precision``."""
    from seamline.quant.matmul import set_int8_activations, set_rows_alone

    set_int8_activations(precision.int8_activations)
    set_rows_alone(precision.rows_alone)


def once(key: str, message: str) -> None:
    """Say ``message`` once per process, at info level: a note on how this machine computes
    (a server's log shows it; a command's one-line error stays one line)."""
    if key not in _SAID:
        _SAID.add(key)
        log.info(message)
