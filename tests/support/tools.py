"""Chat templates of the tool-call formats."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parents[1] / "templates"  # tests/templates
