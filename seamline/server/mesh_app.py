"""The OpenAI API over a mesh: the app for a built ``Mesh``, and `seamline serve`'s main loop."""

from __future__ import annotations

from dataclasses import replace

from fastapi import FastAPI

from seamline.mesh.control.admin import admin_key
from seamline.mesh.control.serve import Mesh, ServeOptions, build_mesh, spawn_node, url_host
from seamline.net.http_guard import serve_once_listening
from seamline.server.api_options import ApiOptions
from seamline.server.openai_api import create_app


def mesh_app(mesh: Mesh, api: ApiOptions | None = None) -> FastAPI:
    """The API over the mesh's backend, with the coordinator's routes (fragments, /api/status,
    administration: its key, made by ``build_mesh``, is checked before an admin body is read)."""
    limits = replace((api or ApiOptions()).limits, admin_key=admin_key(mesh.state_dir))
    return create_app(mesh.backend, extra_routes=mesh.routes, limits=limits)


def run_serve(options: ServeOptions, api: ApiOptions | None = None) -> int:
    api = api or ApiOptions()
    mesh = build_mesh(options)
    mesh.start(options.host)

    def announce() -> None:  # once the API's port listens: what it prints can be used at once
        where = f"{api.scheme}://{url_host(options.host)}:{options.port}/v1"
        print(f"seamline: serving {mesh.coordinator.model.name} on {where}", flush=True)
        print(
            f"seamline: invite token (valid {options.invite_ttl_s / 3600:.0f} h): {mesh.token}",
            flush=True,
        )
        print(f"seamline: join with: seamline join {mesh.token}", flush=True)
        if options.local_node:
            spawn_node(mesh.own_token, "local", extra=["--device", options.device])

    serve_once_listening(
        mesh_app(mesh, api),
        announce,
        options.host,
        options.port,
        log_level="warning",
        **api.uvicorn_kwargs(),
    )
    return 0
