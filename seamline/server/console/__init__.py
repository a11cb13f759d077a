"""The web console at ``/``: the mesh drawn as nodes and links, live rates and requests, the
coordinator's events, and a chat box streaming from the API. Static files shipped in the
package (no build step, no library): the page polls ``/api/status`` and ``/metrics``."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response


def _read(name: str) -> str:
    return files(__package__).joinpath(name).read_text(encoding="utf-8")


def console_routes(app: FastAPI) -> None:
    page, script = _read("index.html"), _read("console.js")
    app.get("/", include_in_schema=False)(lambda: HTMLResponse(page))
    app.get("/console.js", include_in_schema=False)(
        lambda: Response(script, media_type="text/javascript")
    )
