"""Packaging: a checkpoint (Hugging Face folder or GGUF file) written as fragments plus a
manifest (the format is in ``fragments.py``), once per source, into a cache."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from seamline.config import ModelConfig
from seamline.errors import CheckpointError
from seamline.ownership import Ownership, Range
from seamline.quant.scaled import ScaledTensor
from seamline.quant.tensor import QuantTensor
from seamline.weights.fragments import (
    _LAYER,
    EXPERT_CHUNKS,
    FORMAT,
    HEAD_TENSORS,
    SCALES_SUFFIX,
    TOKENIZER_FILES,
    VERSION,
    FragmentEntry,
    Manifest,
    TensorEntry,
    atomic_write,
    file_sha256,
    is_complete,
    model_hash,
)
from seamline.weights.loader import check_names, mtp_missing, open_source
from seamline.weights.names import mtp_plans, stage_plans
from seamline.weights.source import TensorSource
from seamline.weights.v4_names import MTP_SOURCE

log = logging.getLogger(__name__)


def package(model_path: str | Path, out_dir: str | Path, progress: bool = True) -> Manifest:
    """Split a GGUF file or Hugging Face folder into fragments in ``out_dir``; write the manifest last."""
    model_path, out_dir = Path(model_path), Path(out_dir)
    if (
        model_path.suffix == ".gguf"
    ):  # a tokenizer seamline cannot encode, refused before the weights
        from seamline.weights.gguf_file import GGUFFile
        from seamline.weights.gguf_prompt import prompt_ends_from_gguf
        from seamline.weights.gguf_tokenizer import check_tokenizer

        check_tokenizer(GGUFFile.open(model_path))
        prompt_ends_from_gguf(GGUFFile.open(model_path))
    source = open_source(model_path)
    config_dict = json.loads(json.dumps(source.config_dict()))  # as the manifest will hold it
    config = ModelConfig.from_hf_dict(config_dict)
    check_names(source, config)  # nothing missing, nothing unexpected; ignorable ones are dropped
    out_dir.mkdir(parents=True, exist_ok=True)
    entries: list[FragmentEntry] = []
    # the multi-token-prediction layer goes in the fragments of layer N, for a pipeline's last
    # stage (DeepSeek-V3's with its own copy of the embedding; V4's reads the model's)
    mtp = mtp_missing(source, config, embed=True) is None
    groups = _tensor_groups(config, mtp=mtp)
    for group in tqdm(
        groups, desc=f"packaging {model_path.name}", unit="fragment", disable=not progress
    ):
        entries.append(_write_tensors(source, group, out_dir))
    entries += _write_tokenizer(model_path, out_dir)
    name = model_path.stem if model_path.is_file() else model_path.resolve().name
    manifest = Manifest(name, model_hash(config_dict, entries), config_dict, tuple(entries))
    manifest.save(out_dir)
    return manifest


class _Group(NamedTuple):
    """One fragment to write: its name, kind, layer, routed experts and tensor names."""

    name: str
    kind: str
    layer: int | None
    experts: Range | None
    tensors: list[str]


def _tensor_groups(config: ModelConfig, mtp: bool = False) -> list[_Group]:
    """embed, layer.0 (then its routed experts in chunks) .. layer.{L-1} (``mtp``: .. layer.L,
    the multi-token-prediction layer), head."""
    full = Ownership.full(config)
    plans = stage_plans(config, full) + (mtp_plans(config, full, embed=True) if mtp else [])
    names = {n for p in plans for n in p.sources()}
    # routed experts are the stacked plans, one part per expert 0..E-1 (the checkpoint tables' order)
    expert_of = {n: e for p in plans if p.stack for e, part in enumerate(p.parts) for n in part}
    experts = config.num_experts
    per_chunk = experts // math.gcd(experts, EXPERT_CHUNKS) if experts else 0
    groups = {
        "embed": _Group("embed", "embed", None, None, []),
        "head": _Group("head", "head", None, None, []),
    }
    for name in sorted(names):
        layer = _layer_of(name, config)
        if layer is not None:
            expert = expert_of.get(name)
            if expert is None or not per_chunk:
                key, chunk = f"layer.{layer}", None
            else:
                first = expert // per_chunk * per_chunk
                key, chunk = (
                    f"layer.{layer}.experts.{first}-{first + per_chunk}",
                    (first, first + per_chunk),
                )
            group = groups.setdefault(
                key, _Group(key, "experts" if chunk else "layer", layer, chunk, [])
            )
            group.tensors.append(name)
        elif name == "model.embed_tokens.weight":
            groups["embed"].tensors.append(name)
        elif name in HEAD_TENSORS:
            groups["head"].tensors.append(name)
        else:
            raise CheckpointError(f"tensor {name} belongs to no fragment (embed, layer.i, head)")
    order = lambda g: (g.kind != "embed", g.kind == "head", g.layer or 0, g.experts or (-1, -1))  # noqa: E731
    return sorted((g for g in groups.values() if g.tensors), key=order)


def _layer_of(name: str, config: ModelConfig) -> int | None:
    """The layer a tensor belongs to: DeepSeek-V4's multi-token-prediction layer (``mtp.0.*``)
    is layer N, as V3's is."""
    if name.startswith(MTP_SOURCE):
        return config.num_layers
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def _write_tensors(source: TensorSource, group: _Group, out_dir: Path) -> FragmentEntry:
    weights = {n: source.get(n) for n in group.tensors}
    tensors: dict[str, torch.Tensor] = {}
    for n, w in weights.items():
        if isinstance(w, ScaledTensor):  # its values under its name, its scales beside them
            tensors[n], tensors[n + SCALES_SUFFIX] = w.values.contiguous(), w.scales.contiguous()
        else:
            tensors[n] = (w.data if isinstance(w, QuantTensor) else w).contiguous()
    path = out_dir / f"{group.name}.safetensors"
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    table = tuple(TensorEntry(n, tuple(w.shape), _type_name(w)) for n, w in weights.items())
    return FragmentEntry(
        group.name,
        group.kind,
        group.layer,
        path.name,
        path.stat().st_size,
        file_sha256(path),
        table,
        group.experts,
    )


def _type_name(w: torch.Tensor | QuantTensor | ScaledTensor) -> str:
    if isinstance(w, ScaledTensor):
        return w.stored_type
    return w.qtype.name if isinstance(w, QuantTensor) else str(w.dtype).removeprefix("torch.")


def _write_tokenizer(model_path: Path, out_dir: Path) -> list[FragmentEntry]:
    """tokenizer.json + tokenizer_config.json (+ generation_config.json) as tokenizer fragments."""
    if model_path.is_file():
        written = _write_gguf_tokenizer(model_path, out_dir)
    else:
        written = []
        for file in TOKENIZER_FILES:
            if (model_path / file).is_file():
                written.append(out_dir / file)
                atomic_write(written[-1], partial(shutil.copyfile, model_path / file))
        if not written:
            log.warning("%s has no tokenizer files: the package serves token ids only", model_path)
    return [
        FragmentEntry(p.name, "tokenizer", None, p.name, p.stat().st_size, file_sha256(p))
        for p in written
    ]


def _write_gguf_tokenizer(gguf: Path, out_dir: Path) -> list[Path]:
    from seamline.weights.gguf import tokenizer_from_gguf, tokenizer_info_from_gguf
    from seamline.weights.gguf_file import GGUFFile
    from seamline.weights.gguf_prompt import end_of_generation_ids

    tokenizer = tokenizer_from_gguf(gguf)
    info = tokenizer_info_from_gguf(gguf)
    bos = tokenizer.id_to_token(info.bos_token_id) if info.bos_token_id is not None else None
    eos = tokenizer.id_to_token(info.eos_token_ids[0]) if info.eos_token_ids else None
    files: dict[str, dict[str, Any]] = {
        "tokenizer_config.json": {
            "chat_template": info.chat_template,
            "bos_token": bos,
            "eos_token": eos,
            "add_bos_token": info.add_bos_token,
        },
        "generation_config.json": {
            "bos_token_id": info.bos_token_id,
            "eos_token_id": list(end_of_generation_ids(GGUFFile.open(gguf))),
        },
    }
    paths = [out_dir / "tokenizer.json"]
    atomic_write(paths[0], lambda tmp: tokenizer.save(str(tmp)))
    for file, content in files.items():
        paths.append(out_dir / file)
        atomic_write(paths[-1], partial(_write_json, content))
    return paths


def _write_json(content: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(content, indent=1))


def source_key(model_path: str | Path) -> str:
    """The identity of a checkpoint on disk: resolved path, and each file's size and mtime.

    Cheap (no content hash: a 400 GB GGUF would take minutes to hash at every start);
    rewriting or touching a checkpoint file changes the key and repackages it.
    """
    path = Path(model_path).resolve()
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist")
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    ident = [FORMAT, VERSION, str(path)] + [
        [p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files
    ]
    digest = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:24]
    return f"{path.stem if path.is_file() else path.name}-{digest}"


def package_cached(model_path: str | Path, cache_root: str | Path, progress: bool = True) -> Path:
    """Package into ``cache_root/<source_key>``, or reuse a complete earlier package there.

    A package is built in ``<key>.partial`` and renamed into place once its manifest is
    written, so a package folder that exists is complete (one packager per cache at a time).
    """
    cache_root = Path(cache_root)
    final = cache_root / source_key(model_path)
    if is_complete(final):
        log.info("reusing the package of %s at %s", model_path, final)
        return final
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    package(model_path, partial, progress)
    shutil.rmtree(final, ignore_errors=True)  # an incomplete or damaged earlier package
    os.replace(partial, final)
    return final
