"""Invite tokens: where the coordinator is, a secret, an expiry and the mesh CA's fingerprint,
in one pasteable string.

``seamline-`` + base64url(JSON). A joining node proves it holds the secret by answering the
coordinator's random challenge with HMAC-SHA256(secret, nonce); the secret never crosses the
wire. The node knows the coordinator by the CA fingerprint (``mesh.identity``) before it
sends anything, and the coordinator proves it holds the secret too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from seamline.errors import SeamlineError

PREFIX = "seamline-"


class InviteError(SeamlineError):
    """A token that is malformed, expired, or does not match the coordinator's."""


@dataclass(frozen=True)
class Invite:
    hosts: tuple[str, ...]  # coordinator addresses to try, in order
    control_port: int
    http_port: int
    secret: str
    expires: float  # unix time
    ca_fingerprint: str = (
        ""  # sha256 of the mesh CA's certificate; "" for a plaintext mesh (benchmarks)
    )
    id: str = ""  # the coordinator's record of this invite (``invites.InviteBook``)

    def encode(self) -> str:
        body = dict(
            h=list(self.hosts),
            c=self.control_port,
            p=self.http_port,
            s=self.secret,
            e=int(self.expires),
            f=self.ca_fingerprint,
            i=self.id,
        )
        return PREFIX + base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, token: str) -> Invite:
        token = token.strip()
        if not token.startswith(PREFIX):
            raise InviteError("not a seamline invite token (it should start with 'seamline-')")
        try:
            raw = token[len(PREFIX) :]
            body = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
            invite = cls(
                tuple(body["h"]),
                int(body["c"]),
                int(body["p"]),
                str(body["s"]),
                float(body["e"]),
                str(body.get("f", "")),
                str(body.get("i", "")),
            )
        except (ValueError, KeyError, TypeError):
            raise InviteError("invite token is corrupt (copy it again in full)") from None
        return invite

    def check_fresh(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if now > self.expires:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.expires))
            raise InviteError(
                f"invite token expired at {when} UTC; ask the coordinator for a new one"
            )


def new_invite(
    hosts: tuple[str, ...],
    control_port: int,
    http_port: int,
    ttl_s: float,
    ca_fingerprint: str = "",
) -> Invite:
    return Invite(
        hosts, control_port, http_port, secrets.token_hex(16), time.time() + ttl_s, ca_fingerprint
    )


def proof(secret: str, nonce: str) -> str:
    return hmac.new(secret.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def verify(secret: str, nonce: str, answer: str) -> bool:
    return hmac.compare_digest(proof(secret, nonce), answer)


def coordinator_proof(secret: str, nonce: str) -> str:
    """The coordinator's answer to a joining node's nonce; apart from ``proof`` (a prefix), so
    neither side's answer can be played back as the other's."""
    return proof(secret, "coordinator:" + nonce)
