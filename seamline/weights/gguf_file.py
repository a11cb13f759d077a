"""A strict, fast reader for the GGUF container: metadata, tensor table, memory-mapped data.

Why not ``gguf.GGUFReader``: it builds a numpy view per metadata element, so opening the
135M-parameter default model (49k tokens + 49k merges) costs ~6 s and ~160 MB of Python
objects, and a 150k-token vocabulary several times that -- per open. This module parses the
header with ``struct`` (~0.2 s) and leaves tensor bytes in the page cache; the ``gguf``
package still supplies the type constants, block sizes and the dequantisers.

Every structural fault (bad magic, unknown version or value type, a length that runs past
the end of the file, a tensor whose bytes are not all there) is a ``CheckpointError`` that
names the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from seamline.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 used 32-bit counts and is long obsolete
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8

# GGUF metadata value type id -> struct format (scalars); 8 = string, 9 = array.
_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. ``shape`` is in torch order (GGUF's ``ne`` reversed)."""

    name: str
    type_id: int  # raw ggml type id; ``qtype`` is None when gguf does not know it
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def qtype(self) -> GGMLQuantizationType | None:
        try:
            return GGMLQuantizationType(self.type_id)
        except ValueError:
            return None

    @property
    def type_name(self) -> str:
        q = self.qtype
        return q.name if q is not None else f"type id {self.type_id}"


class GGUFFile:
    """A parsed GGUF file. ``open`` does all the parsing; the tensor data stays mapped."""

    def __init__(
        self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo], buf: mmap.mmap
    ) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._buf = buf

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        p = Path(path)
        try:
            with open(p, "rb") as f:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
            raise CheckpointError(f"cannot read GGUF file {p}: {e}") from None
        try:
            metadata, tensors = _parse(buf, p)
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise CheckpointError(
                f"GGUF file {p} is corrupt or truncated in its header ({e})"
            ) from None
        return cls(p, metadata, tensors, buf)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, read-only and zero-copy: uint8 ``[*shape[:-1], bytes_per_row]``."""
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.type_id)]
        row_bytes = info.shape[-1] // block * type_size
        flat = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(*info.shape[:-1], row_bytes)


class _Cursor:
    """Bounds-checked little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise CheckpointError(f"GGUF file {self.path} is truncated: a string runs past the end")
        s = str(self.buf[self.pos : end], "utf-8")
        self.pos = end
        return s

    def value(self, type_id: int) -> Any:
        if type_id in _SCALAR:
            return self.take(_SCALAR[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            return self.array()
        raise CheckpointError(f"GGUF file {self.path} has unknown metadata value type {type_id}")

    def array(self) -> list[Any]:
        item_type, n = self.take("I"), self.take("Q")
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type])
            if self.pos + n * dtype.itemsize > len(self.buf):
                raise CheckpointError(
                    f"GGUF file {self.path} is truncated: an array runs past the end"
                )
            values: list[Any] = np.frombuffer(
                self.buf, dtype=dtype, count=n, offset=self.pos
            ).tolist()
            self.pos += n * dtype.itemsize
            return values
        return [self.value(item_type) for _ in range(n)]


def _parse(buf: mmap.mmap, path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    cur = _Cursor(buf, path)
    if buf[:4] != MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
    cur.pos = 4
    version = cur.take("I")
    if version not in VERSIONS:
        raise CheckpointError(
            f"GGUF file {path} has version {version}; seamline reads little-endian GGUF v2/v3"
        )
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    table = [_tensor_entry(cur) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"GGUF file {path} has alignment {alignment}, not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    return metadata, _tensor_infos(table, data_start, len(buf), path)


def _tensor_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.take("I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise CheckpointError(f"GGUF file {cur.path}: tensor '{name}' has {n_dims} dimensions")
    ne = [cur.take("Q") for _ in range(n_dims)]
    type_id, offset = cur.take("I"), cur.take("Q")
    return name, tuple(reversed(ne)), type_id, offset


def _tensor_infos(
    table: list[tuple[str, tuple[int, ...], int, int]], data_start: int, size: int, path: Path
) -> dict[str, TensorInfo]:
    """Check every tensor's byte range lies inside the file; size it when its type is known."""
    infos: dict[str, TensorInfo] = {}
    for name, shape, type_id, rel_offset in table:
        if name in infos:
            raise CheckpointError(f"GGUF file {path} has two tensors named '{name}'")
        info = TensorInfo(name, type_id, shape, data_start + rel_offset, 0)
        if info.qtype in GGML_QUANT_SIZES:
            block, type_size = GGML_QUANT_SIZES[info.qtype]
            if shape[-1] % block:
                raise CheckpointError(
                    f"GGUF file {path}: tensor '{name}' rows of {shape[-1]} are not whole "
                    f"{info.type_name} blocks of {block}"
                )
            nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
            info = TensorInfo(name, type_id, shape, info.offset, nbytes)
            if info.offset + nbytes > size:
                raise CheckpointError(
                    f"GGUF file {path} is truncated: tensor '{name}' needs bytes "
                    f"[{info.offset}, {info.offset + nbytes}) but the file has {size}"
                )
        infos[name] = info
    return infos
