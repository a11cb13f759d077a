"""A liar that would get its neighbour blamed (`seamline bench fuzz`'s ``liar_blames_neighbour``).

The liar joined with the honest members' own invite (removing a member closes the invite it
came with, so a liar sharing one could once take the honest members out with it). Once armed,
its stage computes and reports honestly, and one frame in ``EVERY`` it sends downstream carries
its rows scaled by 1.05. It takes turns at the three ways to sign such a frame:

- as the honest frame (its digests and bytes): the receiver finds the bytes are not what was
  signed and refuses the frame; the request replays, and no one can show who altered it;
- the hashes of the bytes it sent with the honest digests: the receiver refuses the frame and
  shows the coordinator the row, whose hash the liar signed and whose digest it did not;
- the digests and hashes of what it sent: the receiver computes on it and reports the signed
  statement, which shows the liar sent other than its layers compute when its stage or link is
  checked.

The bench reports ``honest_removed`` (honest members of the route the mesh removed or lost by
the end) beside ``detected_s`` (seconds from armed to the liar's removal).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from seamline.mesh.node.process import Node
from seamline.runtime import digest

MODE = "liar_blames_neighbour"
EVERY = 20  # one frame in this many is altered (5%)


def alters_sent_frames(node: Node, armed: threading.Event, counts: Any) -> None:
    """Wrap ``node``'s downstream sends, once each route is set, as the module says."""
    route = node._route

    def tampered_route(message: Any) -> None:
        route(message)
        worker = node.worker
        downstream = worker.links.downstream if worker is not None else None
        if worker is None or downstream is None:
            return
        sent = [0]

        def send(rows: list[Any], out: torch.Tensor, ids: Any, signed: Any) -> None:
            sent[0] += 1
            if not armed.is_set() or sent[0] % EVERY:
                return downstream(rows, out, ids, signed)
            bad = out * 1.05
            how = counts["frames_altered"] % 3  # 0: honest statement, 1: honest digests, 2: bad
            if how and worker.links.sign is not None:
                said = _digests(rows, bad if how == 2 else out, worker.digest_seed)
                signed = worker.links.sign(_keys(rows), said, bad)
                counts["altered_signed_as_sent" if how == 2 else "altered_with_honest_digests"] += 1
            counts["frames_altered"] += 1
            downstream(rows, bad, ids, signed)

        worker.links.downstream = send

    node._route = tampered_route  # type: ignore[method-assign]


def _keys(rows: list[Any]) -> list[tuple[int, int, int]]:
    return [(r.request, r.position, r.count) for r in rows]


def _digests(rows: list[Any], tensor: torch.Tensor, seed: int) -> torch.Tensor:
    out, at = [], 0
    for row in rows:
        out.append(digest.digest(tensor[at : at + row.count], row.position, seed))
        at += row.count
    return torch.stack(out)


def outcome(status: dict[str, Any], honest: list[str]) -> dict[str, Any]:
    """The honest members the mesh removed, or has lost, by the end (its status then)."""
    members = {n["node_id"] for n in status.get("nodes", [])}
    expelled = set(status.get("verification", {}).get("expelled", []))
    return {"honest_removed": sorted(n for n in honest if n in expelled or n not in members)}
