"""The coordinator's invites: each expiring, limited to N uses, revocable, and good for one thing
only (joining as a node).

An invite is a record here (id, secret, expiry, uses); its token carries the id and the secret.
A joining node names the id and proves the secret against a fresh challenge, and the record
decides: unknown, revoked, expired or used up is refused. Nothing in a token is trusted that
the record does not hold, so a forged or altered token gets nowhere; nodes in turn know the
coordinator by the CA fingerprint the token pins. Each record names the nodes that joined with
it, and removing a node revokes the invites it joined with (its holder could otherwise come
back under a new id). Kept in ``invites.json`` in the state directory (owner-only), so a
restarted coordinator honours the invites it gave out.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from seamline.mesh.protocol.invite import Invite, verify

log = logging.getLogger("seamline.coordinator")


@dataclass
class InviteRecord:
    id: str
    secret: str
    expires: float
    uses: int | None  # None: any number of nodes
    used: int = 0
    revoked: bool = False
    created: float = 0.0
    nodes: list[str] = field(default_factory=list)  # the node ids that joined with it

    def public(self) -> dict[str, object]:
        """What `seamline invite list` shows: everything but the secret."""
        view = {k: v for k, v in asdict(self).items() if k != "secret"}
        view["state"] = self.refusal(time.time()) or "valid"
        return view

    def refusal(self, now: float) -> str:
        if self.revoked:
            return "revoked"
        if now > self.expires:
            return "expired"
        if self.uses is not None and self.used >= self.uses:
            return "used up"
        return ""


class InviteBook:
    def __init__(self, where: Invite, path: Path | None = None) -> None:
        """``where``: the coordinator's addresses and CA fingerprint, which every token carries."""
        self.where = where
        self.path = path
        self._lock = threading.Lock()
        self._records: dict[str, InviteRecord] = self._load()

    def create(self, ttl_s: float, uses: int | None = None) -> tuple[InviteRecord, str]:
        """A new invite and its token."""
        if uses is not None and uses < 1:
            raise ValueError("an invite needs at least one use")
        if ttl_s <= 0:
            raise ValueError("an invite must expire in the future")
        record = InviteRecord(
            secrets.token_hex(6),
            secrets.token_hex(16),
            time.time() + ttl_s,
            uses,
            created=time.time(),
        )
        with self._lock:
            self._records[record.id] = record
            self._save()
        return record, self.token(record)

    def token(self, record: InviteRecord) -> str:
        return Invite(
            self.where.hosts,
            self.where.control_port,
            self.where.http_port,
            record.secret,
            record.expires,
            self.where.ca_fingerprint,
            record.id,
        ).encode()

    def listing(self) -> list[dict[str, object]]:
        with self._lock:
            return [r.public() for r in sorted(self._records.values(), key=lambda r: r.created)]

    def revoke(self, invite_id: str) -> bool:
        with self._lock:
            record = self._records.get(invite_id)
            if record is None:
                return False
            record.revoked = True
            self._save()
        log.warning("invite %s revoked", invite_id)
        return True

    def claim(self, invite_id: str, nonce: str, proof: str, node_id: str = "") -> tuple[str, str]:
        """Spend one use of an invite whose secret ``proof`` proves, for ``node_id``; (the refusal
        or "", the secret)."""
        with self._lock:
            record = self._records.get(invite_id)
            if record is None or not verify(record.secret, nonce, proof):
                return "wrong invite token (unknown, forged or altered)", ""
            refusal = record.refusal(time.time())
            if refusal:
                return (
                    f"the invite token was {refusal}"
                    if refusal != "expired"
                    else "the invite token has expired",
                    "",
                )
            record.used += 1
            if node_id:
                record.nodes.append(node_id)
            self._save()
            return "", record.secret

    def revoke_for(self, node_id: str) -> list[str]:
        """Revoke the invites ``node_id`` joined with (a removed node): whoever holds one could
        join again under a new id, and no use of it tells them from an honest new node. The ids."""
        with self._lock:
            held = [r for r in self._records.values() if node_id in r.nodes and not r.revoked]
            for record in held:
                record.revoked = True
            if held:
                self._save()
        return [r.id for r in held]

    def _load(self) -> dict[str, InviteRecord]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            rows = json.loads(self.path.read_text())
            records = [InviteRecord(**row) for row in rows]
        except (ValueError, TypeError) as exc:
            log.error("ignoring %s, which does not hold invites: %s", self.path, exc)
            return {}
        now = time.time()
        return {r.id: r for r in records if r.expires > now}

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump([asdict(r) for r in self._records.values()], file)
        temporary.replace(self.path)
