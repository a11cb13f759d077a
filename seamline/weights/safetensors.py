"""Hugging Face folders: config.json plus one or several (indexed) safetensors files.

Files are memory-mapped by ``safe_open``; a tensor is read only when ``get`` asks for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from seamline.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32"}


class HFFolderSource:
    """TensorSource over a Hugging Face model folder."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._file_of: dict[str, Path] | None = None
        self._handles: dict[Path, Any] = {}

    def config_dict(self) -> dict[str, Any]:
        path = self.folder / "config.json"
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder} is not a folder")
        if not path.is_file():
            raise CheckpointError(f"{self.folder} has no config.json")
        try:
            return dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from None

    def names(self) -> set[str]:
        return set(self._files())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        return str(self._handle(name).get_slice(name).get_dtype())

    def stored_type(self, name: str) -> str:
        """The torch dtype name ("bfloat16") of a stored tensor."""
        return SAFETENSORS_DTYPES.get(self.dtype_name(name), "float32")

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read tensor {name}: {exc}") from None

    def _files(self) -> dict[str, Path]:
        if self._file_of is None:
            self._file_of = self._index()
        return self._file_of

    def _index(self) -> dict[str, Path]:
        index = self.folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from None
            return {name: self.folder / file for name, file in weight_map.items()}
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.folder} has no .safetensors files")
        return {name: path for path in files for name in self._open(path).keys()}

    def _handle(self, name: str) -> Any:
        path = self._files().get(name)
        if path is None:
            raise CheckpointError(f"checkpoint has no tensor {name}")
        return self._open(path)

    def _open(self, path: Path) -> Any:
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"missing checkpoint file {path}")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise CheckpointError(f"{path} is not a valid safetensors file: {exc}") from None
        return self._handles[path]
