"""A node run in the test process as if on another machine: the coordinator takes nodes whose
links come from one address to share a machine (``plan.cores``), so a node that must count as
another machine dials from another loopback address (all of 127/8 is this machine's loopback)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

LOOPBACK = ("127.0.0.1", "localhost")


def dial_from(monkeypatch: pytest.MonkeyPatch, address: str = "127.0.0.2") -> None:
    """Every connection this process opens to loopback comes from ``address`` from now on."""
    real = socket.create_connection

    def dial(target: Any, timeout: Any = None, source_address: Any = None, **rest: Any) -> Any:
        if source_address is None and target[0] in LOOPBACK:
            source_address = (address, 0)
        if timeout is None:
            return real(target, source_address=source_address, **rest)
        return real(target, timeout, source_address, **rest)

    monkeypatch.setattr(socket, "create_connection", dial)
