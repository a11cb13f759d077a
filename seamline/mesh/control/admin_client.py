"""`seamline invite` and `seamline node`: the administration API (``admin.py``) from the shell.

They run where `seamline serve` runs (or with a copy of its state directory): the state
directory holds the administrator's key and the coordinator's address (``endpoint.json``).
"""

from __future__ import annotations

import json
import os
import re
import ssl
import time
from pathlib import Path
from typing import Any

import httpx

from seamline.errors import SeamlineError
from seamline.mesh.control.admin import ADMIN_KEY_FILE, ADMIN_PREFIX
from seamline.mesh.control.serve import ENDPOINT_FILE

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def default_state_dir() -> Path:
    return Path(os.environ.get("SEAMLINE_CACHE", "~/.cache/seamline")).expanduser() / "mesh"


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``1h``, ``7d`` -> seconds."""
    match = DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise SeamlineError(f"{text!r} is not a duration (say 90s, 30m, 1h or 7d)")
    return float(match.group(1)) * UNIT_S[match.group(2)]


class AdminClient:
    def __init__(self, state_dir: Path, url: str | None = None) -> None:
        key_file, endpoint_file = state_dir / ADMIN_KEY_FILE, state_dir / ENDPOINT_FILE
        if not key_file.is_file() or not endpoint_file.is_file():
            raise SeamlineError(
                f"no running mesh's state in {state_dir} (start `seamline serve`, or pass --state-dir)"
            )
        endpoint = json.loads(endpoint_file.read_text())
        verify: ssl.SSLContext | bool = True
        if endpoint.get("certificate"):
            verify = ssl.create_default_context(cadata=endpoint["certificate"])
            verify.check_hostname = False
        self.http = httpx.Client(
            base_url=url or endpoint["url"],
            verify=verify,
            timeout=30,
            headers={"Authorization": f"Bearer {key_file.read_text().strip()}"},
        )

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            reply = self.http.request(method, ADMIN_PREFIX + path, json=body)
        except httpx.HTTPError as exc:
            raise SeamlineError(
                f"cannot reach the coordinator at {self.http.base_url}: {exc}"
            ) from None
        if reply.status_code != 200:
            raise SeamlineError(
                f"the coordinator refused: {reply.status_code} {reply.json().get('detail', reply.text)}"
            )
        return dict(reply.json())


def format_invites(invites: list[dict[str, Any]]) -> str:
    lines = [f"{'ID':<14}{'STATE':<10}{'USED':>6} {'OF':<6}EXPIRES (UTC)"]
    for invite in invites:
        expires = time.strftime("%Y-%m-%d %H:%M", time.gmtime(float(invite["expires"])))
        uses = "any" if invite["uses"] is None else str(invite["uses"])
        lines.append(
            f"{invite['id']:<14}{invite['state']:<10}{invite['used']:>6} {uses:<6}{expires}"
        )
    return "\n".join(lines)
