"""The mesh's administration API: invites and members, for `seamline invite` and `seamline node`.

Every route takes the administrator's key only (``admin.key`` in the state directory, made by
`seamline serve`, readable by its owner alone), compared in constant time: neither an invite's
secret, a member's fragment token, nor an API key is an administrator's.

- ``POST /api/admin/invites`` ``{"uses": N|null, "expires_s": S}`` -> the invite and its token
- ``GET /api/admin/invites`` -> every invite (no secrets)
- ``DELETE /api/admin/invites/{id}`` -> revoked
- ``DELETE /api/admin/nodes/{id}`` -> the member removed (certificate revoked, links dropped)
- ``PUT /api/admin/balance`` ``{"hold": true|false}`` -> whether the serving plan is held: no
  re-balance from the stages' measured speed while it is (``balance``; a member joining or
  leaving still re-plans)
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Header, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from seamline.mesh.control.coordinator import Coordinator
from seamline.mesh.control.invites import InviteBook

ADMIN_KEY_FILE = "admin.key"
ADMIN_PREFIX = "/api/admin/"


class BalanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hold: bool = Field(strict=True)


class InviteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    uses: int | None = Field(default=None, ge=1)
    expires_s: float = Field(default=24 * 3600, gt=0, le=365 * 24 * 3600)


def admin_key(state_dir: Path) -> str:
    """The administrator's key, made on first use (owner-only file)."""
    path = state_dir / ADMIN_KEY_FILE
    if path.is_file():
        return path.read_text().strip()
    state_dir.mkdir(parents=True, exist_ok=True)
    key = "seamline-admin-" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(key)
    return key


def admin_routes(app: FastAPI, coordinator: Coordinator, book: InviteBook, key: str) -> None:
    def authorise(authorization: str | None) -> None:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), key.encode()
        ):
            raise HTTPException(
                401,
                "the administrator's key is required (admin.key in the mesh's state directory)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @app.post(ADMIN_PREFIX + "invites")
    def create_invite(
        request: InviteRequest, authorization: Annotated[str | None, Header()] = None
    ) -> dict:
        authorise(authorization)
        record, token = book.create(request.expires_s, request.uses)
        return {**record.public(), "token": token}

    @app.get(ADMIN_PREFIX + "invites")
    def list_invites(authorization: Annotated[str | None, Header()] = None) -> dict:
        authorise(authorization)
        return {"invites": book.listing()}

    @app.delete(ADMIN_PREFIX + "invites/{invite_id}")
    def revoke_invite(
        invite_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> dict:
        authorise(authorization)
        if not book.revoke(invite_id):
            raise HTTPException(404, f"no invite {invite_id}")
        return {"id": invite_id, "revoked": True}

    @app.delete(ADMIN_PREFIX + "nodes/{node_id}")
    def remove_node(node_id: str, authorization: Annotated[str | None, Header()] = None) -> dict:
        authorise(authorization)
        if not coordinator.remove_node(node_id):
            raise HTTPException(
                404, f"no member {node_id} (it is barred from rejoining all the same)"
            )
        return {"node_id": node_id, "removed": True}

    @app.put(ADMIN_PREFIX + "balance")
    def hold_plan(
        request: BalanceRequest, authorization: Annotated[str | None, Header()] = None
    ) -> dict:
        authorise(authorization)
        coordinator.balance.held = request.hold
        return {"hold": request.hold, "plan_id": coordinator.plan_id}
