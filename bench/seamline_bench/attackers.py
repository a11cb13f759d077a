"""The attacker's process under `seamline bench fuzz`'s ``attacks``: apart from every honest one.

``python -m seamline_bench.attackers ATTACK TARGET_JSON`` runs one attack against the mesh the
target describes (its API, control and fragment ports, its honest nodes' data and other
listening ports, an invite of the attacker's own, ``duration_s``). It prints JSON lines only:
``{"started": t}`` (t on the machine's monotonic clock, which the bench shares), what an
interactive attack says on the way, and ``{"result": ...}`` at the end. A lying member
(``liar``) runs a node until told ``quit`` (``attack_liar``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from seamline_bench import attack_floods, attack_http, attack_member, attack_net
from seamline_bench.attack_member import emit

ATTACKS: dict[str, Callable[[dict[str, Any], float], dict[str, Any]]] = {
    "oversize_logit_bias": attack_http.oversize_logit_bias,
    "oversize_schema": attack_http.oversize_schema,
    "admin_body": attack_http.admin_body,
    "fd_exhaustion": attack_net.fd_exhaustion,
    "dripped_handshake": attack_net.dripped_handshake,
    "fragments_fd_exhaustion": attack_floods.fragments_fd_exhaustion,
    "comm_fd_exhaustion": attack_floods.comm_fd_exhaustion,
    "forged_pongs": attack_member.forged_pongs,
    "oversize_member_frames": attack_member.oversize_member_frames,
    "removed_member": attack_member.removed_member,
}


def main(argv: list[str]) -> int:
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s %(message)s"
    )
    name, target = argv[0], json.loads(argv[1])
    if name == "liar":
        from seamline_bench.attack_flap import MODES, FailingMember
        from seamline_bench.attack_liar import Liar

        (FailingMember if target["mode"] in MODES else Liar)(target, target["mode"]).run()
        return 0
    emit({"started": time.monotonic()})
    try:
        result = ATTACKS[name](target, float(target["duration_s"]))
    except Exception as exc:  # the attack could not run: the bench reports why
        logging.getLogger("seamline.attacker").exception("attack %s failed", name)
        result = {"error": f"{type(exc).__name__}: {exc}"}
    emit({"result": result, "ended": time.monotonic()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
