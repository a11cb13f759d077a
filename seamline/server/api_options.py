"""`seamline serve`'s options for the HTTP API itself: keys, limits and TLS (as vLLM spells them)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seamline.errors import SeamlineError

KEY_ENV = "SEAMLINE_API_KEY"
DEFAULT_MAX_BODY_MB = 16.0


@dataclass(frozen=True)
class ApiLimits:
    """What the API asks of a caller before any work (``server.guard`` enforces it)."""

    keys: tuple[str, ...] = ()  # none: no key needed
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)
    max_prompt_tokens: int | None = None
    max_concurrent_per_key: int | None = None
    admin_key: str | None = (
        None  # a mesh's administrator's: /api/admin/ takes it only (checked before the body)
    )


@dataclass(frozen=True)
class ApiOptions:
    limits: ApiLimits = field(default_factory=ApiLimits)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def certificate_pem(self) -> str:
        """The certificate (chain) the API is served with, for nodes to trust; "" without TLS."""
        if not self.ssl_certfile:
            return ""
        try:
            return Path(self.ssl_certfile).read_text()
        except OSError as exc:
            raise SeamlineError(f"cannot read --ssl-certfile: {exc}") from None

    def uvicorn_kwargs(self) -> dict[str, Any]:
        return (
            {"ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile}
            if self.ssl_certfile
            else {}
        )


def read_keys(given: Iterable[str], files: Iterable[str], env_value: str | None) -> tuple[str, ...]:
    """API keys from ``--api-key`` values, key files (one per line, ``#`` comments), and an
    environment variable's value (comma-separated)."""
    keys = [k.strip() for k in given]
    for name in files:
        lines = Path(name).read_text().splitlines()
        keys += [
            line.strip() for line in lines if line.strip() and not line.strip().startswith("#")
        ]
    if env_value:
        keys += [k.strip() for k in env_value.split(",")]
    return tuple(dict.fromkeys(k for k in keys if k))


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"a key callers must send as `Authorization: Bearer KEY` (repeatable; also a file "
        f"with --api-key-file, or ${KEY_ENV}, comma-separated: these keep keys out of `ps`)",
    )
    parser.add_argument(
        "--api-key-file", action="append", default=[], metavar="PATH", help="API keys, one per line"
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_MB,
        help="largest request body taken (413 beyond)",
    )
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="longest prompt taken (400 beyond)"
    )
    parser.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=None,
        help="requests in flight per API key, or in all without keys (429 beyond)",
    )
    parser.add_argument(
        "--ssl-certfile", default=None, help="serve the API over HTTPS with this certificate"
    )
    parser.add_argument("--ssl-keyfile", default=None, help="the certificate's private key")


def api_options(args: argparse.Namespace) -> ApiOptions:
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise SeamlineError("--ssl-certfile and --ssl-keyfile go together")
    try:
        keys = read_keys(args.api_key, args.api_key_file, os.environ.get(KEY_ENV))
    except OSError as exc:
        raise SeamlineError(f"cannot read an API key file: {exc}") from None
    limits = ApiLimits(
        keys=keys,
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_prompt_tokens=args.max_prompt_tokens,
        max_concurrent_per_key=args.max_concurrent_per_key,
    )
    return ApiOptions(limits, args.ssl_certfile, args.ssl_keyfile)
