"""A node computes in the precision its coordinator chose (``Assign.int8_activations``,
``rows_alone`` and ``dtype``), never its own: an answer must not depend on which node holds
which layers."""

from __future__ import annotations

from seamline.errors import ConfigError
from seamline.net.messages import Assign
from seamline.precision import int8_kernels_here, label


def take_precision(assign: Assign) -> None:
    """Make this process's quantized matmuls follow ``assign``; a ConfigError (reported to the
    coordinator as this node's failure) when this machine cannot."""
    from seamline.quant.matmul import set_int8_activations, set_rows_alone

    if assign.int8_activations and not int8_kernels_here():
        raise ConfigError(
            "this node cannot run the coordinator's precision: int8-block matmuls need x86-64 "
            "with AVX-512 VNNI and a C++ compiler"
        )
    set_int8_activations(assign.int8_activations)
    set_rows_alone(assign.rows_alone)


def stage_precision(assign: Assign | None) -> str:
    """What the stage loaded for ``assign`` computes in (``precision.label``), as it runs now."""
    from seamline.quant import matmul

    return "" if assign is None else label(assign.dtype, matmul.INT8_ACTIVATIONS)
