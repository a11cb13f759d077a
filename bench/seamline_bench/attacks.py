"""`seamline bench fuzz`'s ``attacks``: known attacks, each against a live 3-node mesh serving 8
legitimate streaming clients (``attack_session``), each attacker in a process of its own
(``attackers``). Per attack: ``mesh_down_s``, ``requests_lost``, ``wrong_answers`` (over the
attack and ``after_s`` after it), ``processes_exited`` (honest ones), and for a lying member
``detected_s`` (from the attack's start until the coordinator shows it removed, lost or its
words refused; null if never), beside what the attacker saw (``attack``) and ``targets_met``.

One mesh takes the attacks that leave it whole, in turn; ``fake_ready`` comes last there (a
liar joins the serving mesh and is planned in). A liar in the route gets a fresh mesh of two
honest nodes and itself, any two of which hold the model, started again until the planner
puts the liar where its attack needs it (``PLACES``): ``stalled_reader`` (stage 0 stops
reading its control link), ``forged_tokens``, ``forged_reports`` (a middle stage says it failed
on every request as it opens) and ``perturbed_hidden`` (with ``--verify-fraction 1``); so does a
failing member (``attack_flap``): ``flapping_member`` (the mesh's re-plans over a minute) and
``refused_frame`` (the seconds from a row sent out of step to its request's replay).
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from seamline.errors import SeamlineError
from seamline_bench import attack_blame, attack_flap
from seamline_bench.attack_claims import claimed_resources, liar_target
from seamline_bench.attack_flap import MODES as FAILING
from seamline_bench.attack_mesh import (
    HONEST_NOFILE,
    LiveMesh,
    attacker,
    node_cap_bytes,
    start,
    wait_until,
)
from seamline_bench.attack_session import (
    CLIENT_TIMEOUT_S,
    CLIENTS,
    TOKENS,
    Session,
    Watcher,
)
from seamline_bench.chaos import ClientAnswer, _request
from seamline_bench.driver import Driver
from seamline_bench.near_tie import TieJudge

SHARED = (
    "oversize_logit_bias",
    "oversize_schema",
    "admin_body",
    "fd_exhaustion",
    "dripped_handshake",
    "fragments_fd_exhaustion",
    "comm_fd_exhaustion",
    "forged_pongs",
    "oversize_member_frames",
    "removed_member",
    "claimed_resources",
    "fake_ready",
)
OWN_MESH = (
    "stalled_reader",
    "forged_tokens",
    "forged_reports",
    "perturbed_hidden",
    attack_blame.MODE,
    *FAILING,
)
CHECKED = ("perturbed_hidden", attack_blame.MODE)  # meshes that check every request
PLACES = {  # where a liar's attack needs it: (its stage, of how many)
    "stalled_reader": lambda at, n: (
        at == 0
    ),  # its control link carries every request's Open and prompt
    "forged_tokens": lambda at, n: at < n - 1,  # not the stage that draws the tokens
    "forged_reports": lambda at, n: 0 < at < n - 1,  # not one that may end a request
    "perturbed_hidden": lambda at, n: True,
    attack_blame.MODE: lambda at, n: at < n - 1,  # it sends frames downstream
    "flapping_member": lambda at, n: True,  # in the route: its failures re-plan the mesh
    "refused_frame": lambda at, n: n > 1,  # it sends rows to another stage
}
ATTACKS = SHARED + OWN_MESH
DURATION_S, AFTER_S = 15.0, 30.0  # each attack's, and how long the mesh is watched after it
LIAR_WITHIN_S = 30.0  # a liar has this long to be found before its attack ends anyway
CONTEXT = 2048


def bench_attacks(
    duration_s: float = DURATION_S, after_s: float = AFTER_S, attacks: tuple[str, ...] = ATTACKS
) -> dict[str, Any]:
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        raise ValueError(f"unknown attacks {sorted(unknown)}: the attacks are {', '.join(ATTACKS)}")
    work = Path(tempfile.mkdtemp(prefix="seamline-attacks-"))
    results: dict[str, dict[str, Any]] = {}
    differ: list[tuple[str, ClientAnswer, str]] = []
    shared = [a for a in SHARED if a in attacks]
    if shared:
        figures, changed = _on_shared_mesh(shared, duration_s, after_s, work)
        results.update(figures)
        differ += changed
    for name in (a for a in OWN_MESH if a in attacks):
        figures, changed = _on_own_mesh(name, duration_s, after_s, work)
        results.update(figures)
        differ += changed
    _tell_near_ties(results, differ)
    for figures in results.values():
        figures["targets_met"] = _targets_met(figures)
    return {name: results[name] for name in ATTACKS if name in results}


def _targets_met(figures: dict[str, Any]) -> bool:
    """No honest process exited, no request lost or answered wrongly, the mesh down 10 s at most,
    and a lying member found within ``LIAR_WITHIN_S``."""
    found = "detected_s" not in figures or (
        figures["detected_s"] is not None and figures["detected_s"] <= LIAR_WITHIN_S
    )
    return (
        figures["processes_exited"] == 0
        and figures["requests_lost"] == 0
        and figures["wrong_answers"] == 0
        and figures["mesh_down_s"] <= 10
        and found
        and figures.get("attack", {}).get("share_within_proven", True)
        and not figures.get("attack", {}).get("honest_removed")
    )


def setup(duration_s: float = DURATION_S, after_s: float = AFTER_S) -> dict[str, Any]:
    """How the attacks were run (``bench fuzz``'s ``attacks_setup``)."""
    return {
        "attack_s": duration_s,
        "watched_after_s": after_s,
        "liar_found_within_s": LIAR_WITHIN_S,
        "legitimate_clients": CLIENTS,
        "tokens_per_request": TOKENS,
        "client_timeout_s": CLIENT_TIMEOUT_S,
        "honest_descriptor_limit": HONEST_NOFILE,
        "meshes": {
            "shared (3 honest nodes, any two hold the model)": list(SHARED),
            "own (2 honest nodes and the liar)": list(OWN_MESH),
        },
        "model": "SmolLM2-135M-Instruct.Q4_1 (float32)",
    }


def _on_shared_mesh(
    names: list[str], duration_s: float, after_s: float, work: Path
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, ClientAnswer, str]]]:
    comm_tls = _comm_certificates(work / "comm-tls")
    mesh = start("shared", work, comm_tls=comm_tls)
    try:
        mesh.server.wait_healthy(600)
        session = Session(mesh, after_s)
        session.start()
        for name in names:
            if name == "fake_ready":
                session.attack(
                    name,
                    lambda: _fake_ready(mesh, work, duration_s),
                    _expelled(mesh, "shared-liar"),
                    True,
                )
            elif name == "claimed_resources":
                session.attack(name, lambda: _claimed_resources(mesh, work, duration_s))
            elif name == "removed_member":
                session.attack(name, lambda: _removed_member(mesh, duration_s))
            else:
                session.attack(name, lambda name=name: _plain(mesh, name, duration_s))  # type: ignore[misc]
        return session.finish()
    finally:
        mesh.close()


def _target(mesh: LiveMesh, duration_s: float) -> dict[str, Any]:
    invite = wait_until(lambda: _invite(mesh), 30)
    return {**mesh.target(duration_s), "invite": invite}


def _invite(mesh: LiveMesh) -> str | None:
    try:
        return mesh.invite()
    except (SeamlineError, httpx.HTTPError, KeyError):  # the API is not up yet
        return None


def _plain(mesh: LiveMesh, name: str, duration_s: float) -> tuple[float, float, dict[str, Any]]:
    """An attack that runs in its process to its end; the bench looks on (a lockstep group formed
    while the comm port is dripped at; the coordinator's log on forged pongs)."""
    driver = attacker(name, _target(mesh, duration_s), mesh.logs)
    started = float(driver.wait_ready()["started"])
    seen: dict[str, Any] = {}
    looking = threading.Thread(target=_look_on, args=(mesh, name, seen), daemon=True)
    looking.start()
    line = driver.result()
    driver.proc.wait(30)
    looking.join(60)
    facts = {**line.get("result", {}), **seen}
    if name == "forged_pongs":
        facts.update(_pongs_refused(mesh, str(facts.get("node_id", "?"))))
    return started, float(line.get("ended", time.monotonic())), facts


def _look_on(mesh: LiveMesh, name: str, seen: dict[str, Any]) -> None:
    if name not in ("dripped_handshake", "comm_fd_exhaustion") or mesh.comm_tls is None:
        return
    from seamline.net.tls import group_tls_from_folder
    from seamline.parallel.comm import CommError, GateTag
    from seamline.parallel.tcp_comm import TcpComm

    time.sleep(1.0)  # the drips (or the flood) have begun
    began = time.monotonic()
    addresses = [("127.0.0.1", 9), ("127.0.0.1", mesh.comm_port)]
    try:
        comm = TcpComm.connect(
            0,
            2,
            addresses,
            10.0,
            "fuzz",
            connect_timeout_s=30.0,
            tls=group_tls_from_folder(mesh.comm_tls, 0, 2),
        )
        total = comm.all_reduce(torch.ones(8), GateTag(0, 0, 0))
        comm.close()
        seen["comm_group_formed_s"] = round(time.monotonic() - began, 2)
        seen["comm_group_sums_right"] = bool(torch.equal(total, torch.full((8,), 2.0)))
    except (CommError, OSError) as exc:  # the group did not form: what the attack must not achieve
        seen["comm_group_error"] = f"{type(exc).__name__}: {exc}"[:200]


def _pongs_refused(mesh: LiveMesh, node_id: str) -> dict[str, Any]:
    """Whether the coordinator refused the forged pongs and link reports, by its log and its plan's links."""
    log = (mesh.logs / f"{mesh.name}.log").read_text(errors="replace")
    pongs = log.count(f"refused node {node_id}'s pong")
    reports = log.count(f"ignored node {node_id}'s link report") + log.count(
        f"link to node {node_id}: a "
    )
    status = mesh.status()
    taken = [
        link
        for link in status.get("links", [])
        if node_id in link.get("nodes", ())
        and ((link.get("rtt_ms") or 0) < 0 or (link.get("bandwidth_mb_s") or 0) > 1e5)
    ]
    return {
        "pongs_refused": pongs,
        "link_reports_refused": reports,
        "forged_links_taken": len(taken),
        "refused": pongs > 0 and reports > 0 and not taken,
    }


def _claimed_resources(
    mesh: LiveMesh, work: Path, duration_s: float
) -> tuple[float, float, dict[str, Any]]:
    target = liar_target(mesh, wait_until(lambda: _invite(mesh), 30), work)
    return claimed_resources(mesh, target, duration_s)


def _removed_member(mesh: LiveMesh, duration_s: float) -> tuple[float, float, dict[str, Any]]:
    """The attacker proves what its certificate opens, the bench removes it (`node remove`), and
    it tries again for ``duration_s``."""
    driver = attacker("removed_member", _target(mesh, duration_s), mesh.logs)
    started = float(driver.wait_ready()["started"])
    said = driver.result()
    removing = time.monotonic()
    mesh.remove(said["member"])
    facts: dict[str, Any] = {"remove_took_s": round(time.monotonic() - removing, 2)}
    line = driver.ask("removed")
    driver.proc.wait(30)
    return started, float(line.get("ended", time.monotonic())), {**line.get("result", {}), **facts}


def _liar_target(mesh: LiveMesh, work: Path, mode: str, node_id: str) -> dict[str, Any]:
    """A liar's: an invite of its own (another for a forger outside the route), its node's options."""
    return {
        **mesh.target(0.0),
        "invite": wait_until(lambda: _invite(mesh), 30),
        "mode": mode,
        "node_id": node_id,
        "max_memory_bytes": node_cap_bytes(),
        "cache_dir": str(work / f"cache-{node_id}"),
        "outsider_invite": wait_until(lambda: _invite(mesh), 30),
        **({"invite": mesh.server.token} if mode == attack_blame.MODE else {}),  # the members'
    }


def _expelled(mesh: LiveMesh, liar: str) -> Watcher:
    return Watcher(
        mesh,
        lambda s: liar in s.get("verification", {}).get("expelled", []),
        lambda s: any(liar in stage.get("ranks", ()) for stage in s.get("stages", [])),
    )


def _fake_ready(
    mesh: LiveMesh, work: Path, duration_s: float
) -> tuple[float, float, dict[str, Any]]:
    """A liar that loads nothing joins the serving mesh; it lies until it is removed, or for
    ``LIAR_WITHIN_S`` at most."""
    launched = time.monotonic()
    driver = attacker("liar", _liar_target(mesh, work, "fake_ready", "shared-liar"), mesh.logs)
    started = float(driver.wait_ready()["joined"])  # the attack begins as it is a member
    wait_until(
        lambda: "shared-liar" in mesh.status().get("verification", {}).get("expelled", []),
        max(duration_s, LIAR_WITHIN_S),
    )
    ended = time.monotonic()
    line = driver.ask("quit")
    driver.proc.wait(30)
    return (
        started,
        ended,
        {**line.get("result", {}), "launched_to_joined_s": round(started - launched, 2)},
    )


def _on_own_mesh(
    name: str, duration_s: float, after_s: float, work: Path
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, ClientAnswer, str]]]:
    """A fresh mesh of two honest nodes and the liar, in the place its attack needs."""
    mesh, driver, liar, stages = _mesh_with_liar(name, work)
    try:
        session = Session(mesh, after_s)
        session.start()
        watcher = {
            "perturbed_hidden": _expelled,
            attack_blame.MODE: _expelled,
            "stalled_reader": _lost,
            "forged_reports": _refused_or_lost,
        }.get(name, _refused)(mesh, liar)
        if name in FAILING:  # a failing member, not a liar to find: it is watched as it fails
            run = lambda: attack_flap.armed(driver, mesh, name, duration_s)  # noqa: E731
            session.attack(name, run)
        else:
            run = lambda: _armed(driver, mesh, liar, name, duration_s)  # noqa: E731
            session.attack(name, run, watcher, lying=True)
        quit_line = driver.ask("quit")
        figures, changed = session.finish()
        figures[name]["attack"].update(
            liar=liar,
            liar_stage=stages.index(liar) if liar in stages else None,
            stages=stages,
            liar_saw=quit_line.get("result", {}),
        )
        if name == attack_blame.MODE:
            honest = [n for n in stages if n != liar]
            figures[name]["attack"].update(attack_blame.outcome(mesh.status(), honest))
        figures[name]["attack"].update(
            attack_flap.after_quit(
                name,
                quit_line.get("result", {}),
                mesh.logs / f"{mesh.name}.log",
            )
        )
        return figures, changed
    finally:
        driver.close()
        mesh.close()


def _mesh_with_liar(
    name: str, work: Path, tries: int = 6
) -> tuple[LiveMesh, Driver, str, list[str]]:
    """The mesh, the liar's process, its id and the stages' nodes in order. The planner places
    nodes of like speed as the links it measured happen to favour: a mesh whose liar is not
    where its attack needs it (``PLACES``) is started again, ``tries`` times at most."""
    mesh_name = name.split("_")[1][:7]
    liar = (
        f"{mesh_name}-liar" if name == "stalled_reader" else f"{mesh_name}0-liar"
    )  # like speeds: planned in id order
    for attempt in range(tries):
        mesh = start(
            mesh_name,
            work / f"{name}-{attempt}",
            honest_nodes=2,
            nodes_expected=3,
            verify_fraction=1.0 if name in CHECKED else 0.0,
        )
        driver = attacker("liar", _liar_target(mesh, work, name, liar), mesh.logs)
        driver.wait_ready()
        mesh.server.wait_healthy(600)
        stages = [s["node_id"] for s in mesh.status().get("stages", [])]
        if liar in stages and PLACES[name](stages.index(liar), len(stages)) or attempt == tries - 1:
            return mesh, driver, liar, stages
        driver.close()
        mesh.close()
    raise AssertionError("unreachable")


def _refused(mesh: LiveMesh, liar: str) -> Watcher:
    return Watcher(mesh, lambda s: s.get("refused_from_members", {}).get(liar, 0) > 0)


def _refused_or_lost(mesh: LiveMesh, liar: str) -> Watcher:
    """A member's report of its own failure is believed of itself alone: it is taken for lost
    (it may rejoin before the next poll: then it is seen out of the route the mesh serves on)."""
    return Watcher(
        mesh,
        lambda s: (
            s.get("refused_from_members", {}).get(liar, 0) > 0
            or (bool(s.get("nodes")) and liar not in {n["node_id"] for n in s["nodes"]})
            or (
                bool(s.get("ready"))
                and liar not in {r for st in s.get("stages", []) for r in st["ranks"]}
            )
        ),
    )


def _lost(mesh: LiveMesh, liar: str) -> Watcher:
    return Watcher(
        mesh, lambda s: bool(s.get("nodes")) and liar not in {n["node_id"] for n in s["nodes"]}
    )


def _armed(
    driver: Any, mesh: LiveMesh, liar: str, name: str, duration_s: float
) -> tuple[float, float, dict[str, Any]]:
    """Arm the liar; the attack lasts ``duration_s`` (a liar that must be removed lies until it
    is, or ``LIAR_WITHIN_S`` at most)."""
    started = float(driver.ask("arm")["armed"])
    if name in CHECKED:
        wait_until(
            lambda: liar in mesh.status().get("verification", {}).get("expelled", []),
            max(duration_s, LIAR_WITHIN_S),
        )
    else:
        time.sleep(duration_s)
    return started, time.monotonic(), {}


def _tell_near_ties(
    results: dict[str, dict[str, Any]], differ: list[tuple[str, ClientAnswer, str]]
) -> None:
    """Answers that first differ from their calm one at a near tie are counted apart."""
    if not differ:
        for figures in results.values():
            figures["near_tie_flips"] = 0
        return
    judge = TieJudge(CONTEXT)
    for figures in results.values():
        figures["near_tie_flips"] = 0
    for name, answer, calm in differ[:64]:  # more than that is no near tie
        if judge.near_tie(_request(answer.client)["messages"], calm, answer.text):
            results[name]["near_tie_flips"] += 1
            results[name]["wrong_answers"] -= 1


def _comm_certificates(folder: Path) -> Path:
    from seamline_bench.fuzz import _comm_certificates as make

    return make(folder)
