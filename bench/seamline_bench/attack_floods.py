"""Floods at the ports that take TLS after the accept (`seamline bench fuzz`'s ``attacks``):

- ``fragments_fd_exhaustion``: connections that never send a ClientHello, held open, to the
  coordinator's fragment port and to every honest node's other ports (its fragment port among
  them), ``attack_net.PER_PORT`` at most each, from ``attack_net.STRANGER``;
- ``comm_fd_exhaustion``: the same at a lockstep rank's comm port while the bench forms a group
  with that rank (``attacks._look_on``).

Each port should cut them from its accept on (``net.admission``): what the attacker reports is
how many it opened and how many the mesh had closed while they were held.
"""

from __future__ import annotations

import resource
import socket
import time
from typing import Any

from seamline_bench.attack_net import PER_PORT, STRANGER, Address, _closed_count


def fragments_fd_exhaustion(target: dict[str, Any], duration_s: float) -> dict[str, Any]:
    named: dict[str, Address] = {"coordinator_fragments": tuple(target["fragments"])}  # type: ignore[dict-item]
    for node in target["nodes"]:
        for port in node["other_ports"]:
            named[f"{node['node_id']}:{port}"] = ("127.0.0.1", int(port))
    return _hold(named, duration_s)


def comm_fd_exhaustion(target: dict[str, Any], duration_s: float) -> dict[str, Any]:
    if not target.get("comm"):
        return {"error": "the mesh has no comm port to flood"}
    return _hold({"comm": tuple(target["comm"])}, duration_s)  # type: ignore[dict-item]


def _hold(named: dict[str, Address], duration_s: float) -> dict[str, Any]:
    """Idle connections to each of ``named``, opened within half the attack (each port its share
    of that time), held to its end, then dropped at once."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    began = time.monotonic()
    held: list[socket.socket] = []
    opened: dict[str, int] = {}
    for index, (name, address) in enumerate(named.items()):
        until = began + duration_s / 2 * (index + 1) / len(named)
        opened[name] = _flood(address, held, min(PER_PORT, hard - len(held) - 64), until)
    filled_s = time.monotonic() - began
    time.sleep(max(0.0, duration_s - filled_s))
    closed_by_server = _closed_count(held)
    for sock in held:
        sock.close()
    return {
        "connections_opened": opened,
        "held": len(held),
        "closed_by_the_mesh_while_held": closed_by_server,
        "seconds_to_open": round(filled_s, 1),
        "nofile_limit": hard,
    }


def _flood(address: Address, held: list[socket.socket], most: int, until: float) -> int:
    """Up to ``most`` connections until ``until``, dialling on while the port is closed a moment
    (a comm port listens only while its rank forms a group)."""
    count = 0
    while count < most and time.monotonic() < until:
        try:
            held.append(
                socket.create_connection(address, timeout=0.2, source_address=(STRANGER, 0))
            )
            count += 1
        except OSError:
            time.sleep(0.05)
    return count
