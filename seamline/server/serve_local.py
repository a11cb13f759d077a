"""``seamline serve --single``: the OpenAI API over one process that owns the whole model."""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from pathlib import Path

from seamline.app import LocalModel, default_model_path
from seamline.net.http_guard import serve_once_listening
from seamline.runtime.backend import LocalBackend
from seamline.runtime.kv_budget import kv_budget_bytes
from seamline.runtime.openmp import on_passing_thread
from seamline.runtime.speculation import Speculation
from seamline.server.api_options import ApiOptions
from seamline.server.openai_api import create_app


def model_name_for(path: str | Path) -> str:
    """The served name: a file's name without its suffix, or a folder's name.

    ``.../SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct.Q4_1``;
    ``.../Qwen2.5-0.5B-Instruct/`` -> ``Qwen2.5-0.5B-Instruct``.
    """
    path = Path(path)
    return path.stem if path.is_file() else path.name


def local_backend(
    model_path: str | None,
    dtype: str | None,
    context: int | None = None,
    kv_cache_bytes: int = 0,
    precision: str = "fast",
    speculation: Speculation | None = None,
    device: str = "auto",
) -> tuple[LocalBackend, LocalModel]:
    """The model (the embedded default when ``model_path`` is None) in ``precision`` (``dtype``,
    when given, overriding its activation dtype), behind a ``LocalBackend`` that speculates as
    ``speculation`` says (the default: ``auto``).

    It is loaded on a thread that ends (``on_passing_thread``): the batch loop's thread, which
    generates, then holds the process's only OpenMP pool, whose workers spin between regions."""
    path = Path(model_path) if model_path else default_model_path()
    speculation = speculation or Speculation()
    layer = (
        "off" if speculation.draft_model is not None else speculation.mode
    )  # the MTP layer: not with a draft model
    model = on_passing_thread(
        lambda: LocalModel.load(path, dtype, context, precision, layer, device)
    )
    budget = kv_budget_bytes(kv_cache_bytes, model.engine.stage.input_device)
    speculation = speculation.for_model(getattr(model.engine.stage, "mtp", None) is not None)
    if speculation.draft_model is not None:
        from seamline.runtime.draft_model import DraftModel, draft_share

        stage = model.engine.stage
        drafting = on_passing_thread(
            lambda: DraftModel.load(speculation.draft_model, stage.config, stage.compute_dtype)
        )  # type: ignore[arg-type]
        drafting.budget_bytes = draft_share(
            budget, stage, drafting.stage
        )  # the drafting caches' share of the budget
        budget -= drafting.budget_bytes
        speculation = replace(speculation, source=drafting.draft)
    backend = LocalBackend(
        model.engine,
        model.codec,
        model_name_for(path),
        kv_budget_bytes=budget,
        speculation=speculation,
    )
    return backend, model


def serve_local(
    model_path: str | None,
    host: str,
    port: int,
    dtype: str | None,
    context: int | None = None,
    kv_cache_bytes: int = 0,
    api: ApiOptions | None = None,
    precision: str = "fast",
    speculation: Speculation | None = None,
    device: str = "auto",
) -> None:
    """Load the model (the embedded default when ``model_path`` is None), then serve until stopped."""
    backend, model = local_backend(
        model_path, dtype, context, kv_cache_bytes, precision, speculation, device
    )
    api = api or ApiOptions()
    app = create_app(backend, limits=api.limits)
    logging.getLogger("seamline").setLevel(logging.INFO)

    def announce() -> None:  # once the port listens: the address printed can be used at once
        print(
            f"seamline: serving {backend.model_name} at {api.scheme}://{host}:{port}/v1, precision "
            f"{model.precision.describe()}",
            file=sys.stderr,
            flush=True,
        )

    serve_once_listening(app, announce, host, port, log_level="info", **api.uvicorn_kwargs())
