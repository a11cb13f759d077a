"""Fragments: a checkpoint split into per-layer safetensors files plus a manifest.

A package is one folder::

    manifest.json             format, version, model, model_hash, config, fragments
    embed.safetensors         model.embed_tokens.weight
    layer.{i}.safetensors     every model.layers.{i}.* tensor, under its Hugging Face name, but
    layer.{i}.experts.{a}-{b}.safetensors   the routed experts [a, b) of an MoE layer, in
                              gcd(E, 8) chunks, so a lockstep rank fetches only its experts
    layer.{N}.safetensors     the multi-token-prediction layer, where the checkpoint has one
                              (DeepSeek-V3's layer N, V4's mtp.0.*): the last stage's drafts
    head.safetensors          model.norm.weight (+ lm_head.weight when the head is untied)
    tokenizer.json, tokenizer_config.json [, generation_config.json, chat_template.jinja]

Tensors are written exactly as the TensorSource reads them (so a split model computes what
the single-process engine computes): a GGUF tensor of a kept quant type as its GGUF block
bytes unchanged (a uint8 tensor; the manifest's tensor entry gives the quant type as its
``dtype``, e.g. ``"Q4_K"``, and the logical shape), other GGUF tensors and a Hugging Face
folder's in their loaded dtype. With tied embeddings the head fragment holds only the norm
and the manifest's ``tie_word_embeddings`` makes ``fragments_for`` give the last stage
``embed`` too: no weight is stored twice. ``model_hash`` is sha256 over the canonical config
JSON, the sorted ``"<name> <sha256>"`` lines of every fragment (tokenizer files included)
and every tensor entry's name, shape and dtype.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from seamline.config import ModelConfig
from seamline.errors import CheckpointError, ConfigError
from seamline.ownership import Range
from seamline.quant.scaled import KIND_NAMES, ScaledTensor
from seamline.quant.tensor import QUANT_TYPES, QuantTensor

FORMAT = "seamline-fragments"
VERSION = 3  # 2: routed experts in their own fragments; 3: quantized tensors as GGUF blocks
MANIFEST_NAME = "manifest.json"
STAMP_SUFFIX = ".verified"  # beside a fragment in a node's cache: its sha256 was checked
KINDS = ("embed", "layer", "experts", "head", "tokenizer")
EXPERT_CHUNKS = 8  # routed experts per MoE layer go in gcd(E, 8) fragments: whole for 2, 4, 8 ranks
# Files of a Hugging Face folder that the text edge (seamline.text) reads, copied as-is.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)
HEAD_TENSORS = (
    "model.norm.weight",
    "lm_head.weight",  # DeepSeek-V4's: its head, and its hyper-head
    "head.weight",
    "model.hc_head.hc_fn",
    "model.hc_head.hc_base",
    "model.hc_head.hc_scale",
)
QUANT_NAMES = {q.name: q for q in QUANT_TYPES}
SCALED_KINDS = {name: kind for kind, name in KIND_NAMES.items()}  # DeepSeek's fp8 / fp4 weights
SCALES_SUFFIX = ".scales"  # a scaled weight's scales, beside its values in the fragment
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorEntry:
    name: str  # Hugging Face name
    shape: tuple[int, ...]
    dtype: str  # torch dtype without the "torch." prefix ("float32", "bfloat16"), or a quant type ("Q4_K")


@dataclass(frozen=True)
class FragmentEntry:
    name: str  # "embed", "layer.3", "layer.3.experts.0-8", "head", or the tokenizer file's name
    kind: str  # one of KINDS
    layer: int | None  # the layer index for kinds "layer" and "experts", else None
    file: str  # file name inside a package folder
    bytes: int
    sha256: str
    tensors: tuple[TensorEntry, ...] = ()
    experts: Range | None = None  # kind "experts": the routed experts [a, b) it holds

    def to_json(self) -> dict[str, Any]:
        tensors = [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.tensors]
        experts = None if self.experts is None else list(self.experts)
        return {
            "name": self.name,
            "kind": self.kind,
            "layer": self.layer,
            "file": self.file,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "tensors": tensors,
            "experts": experts,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FragmentEntry:
        tensors = tuple(
            TensorEntry(str(t["name"]), tuple(int(s) for s in t["shape"]), str(t["dtype"]))
            for t in d.get("tensors", [])
        )
        layer, experts = d.get("layer"), d.get("experts")
        return cls(
            str(d["name"]),
            str(d["kind"]),
            None if layer is None else int(layer),
            str(d["file"]),
            int(d["bytes"]),
            str(d["sha256"]),
            tensors,
            None if experts is None else (int(experts[0]), int(experts[1])),
        )


@dataclass(frozen=True)
class Manifest:
    model: str
    model_hash: str
    config: dict[str, Any]  # the Hugging Face config.json dict
    fragments: tuple[FragmentEntry, ...]

    @property
    def num_layers(self) -> int:
        return ModelConfig.from_hf_dict(self.config).num_layers

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def fragment(self, name: str) -> FragmentEntry:
        for entry in self.fragments:
            if entry.name == name:
                return entry
        raise CheckpointError(f"manifest of {self.model} has no fragment {name}")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "model_hash": self.model_hash,
            "tie_word_embeddings": self.tie_word_embeddings,
            "num_layers": self.num_layers,
            "config": self.config,
            "fragments": [f.to_json() for f in self.fragments],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise CheckpointError(
                f"manifest is format {d.get('format')!r} version {d.get('version')!r}; "
                f"seamline reads {FORMAT!r} version {VERSION}"
            )
        try:
            fragments = tuple(FragmentEntry.from_json(f) for f in d["fragments"])
            manifest = cls(str(d["model"]), str(d["model_hash"]), dict(d["config"]), fragments)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"manifest is malformed: {exc!r}") from None
        manifest.verify()
        return manifest

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        """From a package folder or its manifest.json."""
        path = Path(path)
        path = path / MANIFEST_NAME if path.is_dir() else path
        if not path.is_file():
            raise CheckpointError(f"no fragment manifest at {path}")
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from None

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        text = json.dumps(self.to_json(), indent=1)
        atomic_write(path, lambda tmp: tmp.write_text(text))
        return path

    def verify(self) -> None:
        """Names and files unique, hashes well-formed, kinds known, model_hash consistent."""
        for attr in ("name", "file"):
            values = [getattr(f, attr) for f in self.fragments]
            if len(set(values)) != len(values):
                raise CheckpointError(f"manifest of {self.model} repeats a fragment {attr}")
        for f in self.fragments:
            if f.kind not in KINDS or not _SHA256.match(f.sha256) or Path(f.file).name != f.file:
                raise CheckpointError(
                    f"manifest fragment {f.name}: kind {f.kind!r}, sha256 {f.sha256!r} and "
                    f"file {f.file!r} must be one of {KINDS}, 64 lowercase hex digits, a bare name"
                )
            if (f.kind == "experts") != (f.experts is not None and f.layer is not None):
                raise CheckpointError(
                    f"manifest fragment {f.name}: only an experts fragment has a layer's "
                    f"expert range, and it must have one (kind {f.kind!r}, experts {f.experts})"
                )
        expected = model_hash(self.config, self.fragments)
        if expected != self.model_hash:
            raise CheckpointError(
                f"manifest model_hash {self.model_hash} does not match its fragments and config "
                f"({expected})"
            )


def model_hash(config: dict[str, Any], fragments: Iterable[FragmentEntry]) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    fragments = list(fragments)
    lines = [f"{f.name} {f.sha256}" for f in fragments]
    lines += [f"{t.name} {list(t.shape)} {t.dtype}" for f in fragments for t in f.tensors]
    for line in sorted(lines):
        h.update(b"\n" + line.encode())
    return h.hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` then rename onto ``path``: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- packaging


def is_complete(folder: Path) -> bool:
    """A manifest that loads, and every fragment file it names at its stated size."""
    try:
        manifest = Manifest.load(folder)
    except CheckpointError:
        return False
    return all(_has_file(folder, f) for f in manifest.fragments)


def _has_file(folder: Path, entry: FragmentEntry) -> bool:
    path = folder / entry.file
    return path.is_file() and path.stat().st_size == entry.bytes


# ---------------------------------------------------------------- reading


def fragments_for(
    manifest: Manifest,
    layer_range: Range,
    owns_embedding: bool,
    owns_head: bool,
    experts: Range | None = None,
    mtp: bool = False,
) -> list[FragmentEntry]:
    """The fragments a stage owning ``[start, end)`` (and the embedding / head) needs; of
    the routed experts only the chunks that hold one of ``experts`` (None: every expert);
    with ``mtp`` the multi-token-prediction layer's too (layer ``num_layers``).

    The last stage of a tied model also needs ``embed`` (its head is the embedding), and so does
    one drafting with a layer that has no copy of its own (DeepSeek-V4's); stage 0 and the last
    stage get the tokenizer files.
    """
    start, end = layer_range
    if not 0 <= start < end <= manifest.num_layers:
        raise ConfigError(f"layer range [{start},{end}) is not inside [0,{manifest.num_layers})")
    in_range = lambda f: (
        f.layer is not None and (start <= f.layer < end or (mtp and f.layer == manifest.num_layers))
    )  # noqa: E731
    wants: dict[str, Callable[[FragmentEntry], bool]] = {
        "layer": in_range,
        "experts": lambda f: in_range(f) and (experts is None or _overlaps(f.experts, experts)),
        "embed": lambda f: (
            owns_embedding
            or (owns_head and (manifest.tie_word_embeddings or mtp and _mtp_reads_embed(manifest)))
        ),
        "head": lambda f: owns_head,
        "tokenizer": lambda f: owns_embedding or owns_head,
    }
    return [f for f in manifest.fragments if wants[f.kind](f)]


def _mtp_reads_embed(manifest: Manifest) -> bool:
    """Whether the multi-token-prediction layer (layer N) reads the model's embedding: it has no
    copy of its own in its fragment."""
    layer = [f for f in manifest.fragments if f.layer == manifest.num_layers]
    return not any(t.name.endswith("embed_tokens.weight") for f in layer for t in f.tensors)


def _overlaps(chunk: Range | None, wanted: Range) -> bool:
    return chunk is not None and chunk[0] < wanted[1] and wanted[0] < chunk[1]


class FragmentSource:
    """TensorSource over a folder holding a manifest and some of its fragment files.

    ``names()`` lists every tensor in the manifest, so the loader's whole-model check still
    applies; ``get`` of a tensor whose fragment is absent raises a CheckpointError.
    """

    def __init__(self, folder: str | Path, manifest: Manifest | None = None) -> None:
        self.folder = Path(folder)
        self._manifest = manifest
        self._where: dict[str, tuple[FragmentEntry, TensorEntry]] | None = None
        self._handles: dict[str, Any] = {}

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = Manifest.load(self.folder)
        return self._manifest

    def names(self) -> set[str]:
        return set(self._index())

    def shape(self, name: str) -> tuple[int, ...]:
        return self._lookup(name)[1].shape

    def get(self, name: str) -> torch.Tensor | QuantTensor:
        fragment, entry = self._lookup(name)
        try:
            # a copy in the process's own memory: safetensors' tensor is a view of the file's
            # mapping, which the torch path's dequantising passes read 1.5-5x slower (measured)
            tensor = self._open(fragment, name).get_tensor(name).clone()
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(
                f"cannot read tensor {name} from fragment {fragment.name}: {exc}"
            ) from None
        if entry.dtype in SCALED_KINDS:
            scales = self._open(fragment, name).get_tensor(name + SCALES_SUFFIX).clone()
            try:
                return ScaledTensor(SCALED_KINDS[entry.dtype], tensor, scales, entry.shape)
            except CheckpointError as exc:
                raise CheckpointError(f"tensor {name} in fragment {fragment.name}: {exc}") from None
        if entry.dtype not in QUANT_NAMES:
            return tensor
        try:  # the constructor checks the bytes against the type and shape
            return QuantTensor(QUANT_NAMES[entry.dtype], tensor, entry.shape)
        except CheckpointError as exc:
            raise CheckpointError(f"tensor {name} in fragment {fragment.name}: {exc}") from None

    def stored_type(self, name: str) -> str:
        return self._lookup(name)[1].dtype

    def config_dict(self) -> dict[str, Any]:
        return dict(self.manifest.config)

    def present(self) -> list[FragmentEntry]:
        """The manifest's fragments whose files are in the folder at their stated size."""
        return [f for f in self.manifest.fragments if _has_file(self.folder, f)]

    def _index(self) -> dict[str, tuple[FragmentEntry, TensorEntry]]:
        if self._where is None:
            self._where = {t.name: (f, t) for f in self.manifest.fragments for t in f.tensors}
        return self._where

    def _lookup(self, name: str) -> tuple[FragmentEntry, TensorEntry]:
        found = self._index().get(name)
        if found is None:
            raise CheckpointError(f"manifest of {self.manifest.model} has no tensor {name}")
        return found

    def _open(self, fragment: FragmentEntry, name: str) -> Any:
        if fragment.file not in self._handles:
            path = self.folder / fragment.file
            if not path.is_file():
                raise CheckpointError(
                    f"fragment {fragment.name} (holding {name}) is not present on this node "
                    f"(no {path}); fetch the fragments of this stage's range first"
                )
            if path.stat().st_size != fragment.bytes:
                raise CheckpointError(
                    f"fragment {fragment.name} at {path} has {path.stat().st_size} bytes, "
                    f"the manifest says {fragment.bytes}"
                )
            self._handles[fragment.file] = safe_open(str(path), framework="pt")
        return self._handles[fragment.file]
