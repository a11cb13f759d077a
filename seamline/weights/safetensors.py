"""Hugging Face folders: config.json plus one or several (indexed) safetensors files.

Files are memory-mapped by ``safe_open``; a tensor is read only when ``get`` asks for it.

A weight stored as low-bit values with block scales (DeepSeek's fp8 and packed fp4: ``X.weight``
beside ``X.scale`` or ``X.weight_scale_inv``) is one tensor here, a ``ScaledTensor`` of its
logical shape; its scales are not listed apart. A DeepSeek-V4 folder in the original
checkpoint's spelling (``layers.0.attn.wq_a.weight``, ``embed.weight``) is read under the names
transformers writes (``weights/v4_names.py``). Gemma's norm weights w (its norms multiply by
1 + w) are read as 1 + w, as llama.cpp's converter writes them to GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from seamline.errors import CheckpointError
from seamline.quant.scaled import KIND_NAMES, ScaledTensor, scale_values
from seamline.weights import oss_experts
from seamline.weights.gemma3_folder import gemma3_text_config, gemma3_text_names

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SAFETENSORS_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
}
OFFSET_NORM_FAMILIES = ("gemma3_text", "gemma3")  # norm weights w stored for a 1 + w multiply
SCALE_SUFFIXES = (
    ".scale",
    ".weight_scale_inv",
)  # a low-bit weight's block scales, beside ``X.weight``


class HFFolderSource:
    """TensorSource over a Hugging Face model folder."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._file_of: dict[str, Path] | None = None
        self._scale_of: dict[str, str] | None = None
        self._spelling: dict[str, str] = {}  # our name -> the file's, where they differ
        self._handles: dict[Path, Any] = {}
        self._model_type: str | None = None  # config.json's, read once
        self._experts: dict[
            str, oss_experts.ExpertPart
        ] = {}  # gpt-oss: one expert's name -> where it lies
        self._side: dict[str, Path] = {}  # gpt-oss: its MXFP4 scales' files

    def config_dict(self) -> dict[str, Any]:
        """config.json; of a multimodal Gemma 3 folder, its text model's (``text_config``)."""
        raw = self._raw_config()
        return gemma3_text_config(raw) if raw.get("model_type") == "gemma3" else raw

    def _raw_config(self) -> dict[str, Any]:
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
        return set(self._files()) - set(self._scales().values())

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._handle(name).get_slice(self._stored(name)).get_shape())
        if name in self._experts:  # gpt-oss: one expert of a stacked tensor
            return oss_experts.expert_shape(self._experts[name], shape)
        packed = name in self._scales() and self.dtype_name(name) in ("I8", "U8")
        return (*shape[:-1], 2 * shape[-1]) if packed else shape  # two fp4 values a byte

    def dtype_name(self, name: str) -> str:
        return str(self._handle(name).get_slice(self._stored(name)).get_dtype())

    def stored_type(self, name: str) -> str:
        """The torch dtype name ("bfloat16") of a stored tensor, or a scaled weight's kind."""
        if name in self._scales():
            return KIND_NAMES["fp8" if self.dtype_name(name).startswith("F8") else "fp4"]
        if name in self._experts and self._experts[name].scales is not None:
            return KIND_NAMES["fp4"]  # gpt-oss's MXFP4
        return SAFETENSORS_DTYPES.get(self.dtype_name(name), "float32")

    def get(self, name: str) -> torch.Tensor | ScaledTensor:
        if name in self._experts:
            return self._expert(name)
        tensor = self._read(name)
        scale = self._scales().get(name)
        if scale is None:
            return (
                tensor.float() + 1.0
                if self._offset_norms() and name.endswith("norm.weight")
                else tensor
            )
        kind = "fp8" if tensor.dtype == torch.float8_e4m3fn else "fp4"
        try:
            return ScaledTensor(kind, tensor, scale_values(self._read(scale)))
        except CheckpointError as exc:
            raise CheckpointError(f"tensor {name}: {exc}") from None

    def _offset_norms(self) -> bool:
        """Gemma's norms multiply by 1 + weight: read as that (in float32), as llama.cpp's
        converter writes them, so every norm here multiplies by its weight."""
        return self._family() in OFFSET_NORM_FAMILIES

    def _family(self) -> str:
        if self._model_type is None:
            self._model_type = str(self._raw_config().get("model_type"))
        return self._model_type

    def _read(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(self._stored(name))
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read tensor {name}: {exc}") from None

    def _stored(self, name: str) -> str:
        return self._spelling.get(name, name)

    def _scales(self) -> dict[str, str]:
        """Weight name -> its scales' name, for the weights stored with block scales."""
        if self._scale_of is None:
            names = set(self._files())
            self._scale_of = {}
            for name in names:
                for suffix in SCALE_SUFFIXES:
                    weight = name.removesuffix(suffix) + ".weight"
                    if name.endswith(suffix) and weight in names:
                        self._scale_of[weight] = name
        return self._scale_of

    def _files(self) -> dict[str, Path]:
        if self._file_of is None:
            files = self._index()
            if self.config_dict().get("model_type") == "deepseek_v4" and "embed.weight" in files:
                from seamline.weights.v4_names import v4_alias

                self._spelling = {v4_alias(n): n for n in files}
                files = {v4_alias(n): path for n, path in files.items()}
            if self._family() == "gpt_oss":
                files = self._split_experts(files)
            if self._family() == "gemma3":
                self._spelling, files = gemma3_text_names(files)
            self._file_of = files
        return self._file_of

    def _split_experts(self, files: dict[str, Path]) -> dict[str, Path]:
        """gpt-oss's stacked experts, one name per expert (``weights/oss_experts.py``)."""
        listed, self._experts, self._side = oss_experts.split(
            files, int(self.config_dict()["num_local_experts"])
        )
        self._spelling.update({name: part.stored for name, part in self._experts.items()})
        return listed

    def _expert(self, name: str) -> torch.Tensor | ScaledTensor:
        part = self._experts[name]
        if part.scales is not None and part.scales not in self._side:
            raise CheckpointError(f"checkpoint has no tensor {part.scales} beside {part.stored}")
        try:
            one = self._handle(name).get_slice(part.stored)[part.index]
            scales = (
                None
                if part.scales is None
                else self._open(self._side[part.scales]).get_slice(part.scales)[part.index]
            )
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read tensor {name}: {exc}") from None
        try:
            return oss_experts.expert_tensor(part, one, scales)
        except CheckpointError as exc:
            raise CheckpointError(f"tensor {part.scales or name}: {exc}") from None

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
