"""The embedded model for CUDA checks: the installed file, or where it is not installed (a device
machine gets the project's files only, not the 98 MB file) its shapes with random weights."""

from __future__ import annotations

from pathlib import Path


def embedded_or_standin() -> Path:
    try:
        from seamline.app import default_model_path

        return default_model_path()
    except Exception:  # not installed here
        from seamline_bench.gpu_models import embedded_shaped_path

        return embedded_shaped_path()
