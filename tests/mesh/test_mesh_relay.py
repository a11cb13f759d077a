"""A node that takes no inbound connection joins through the coordinator's relay and serves.

Two network namespaces joined by a veth pair: the coordinator and node ``open`` in the first,
node ``walled`` in the second, whose firewall drops every inbound connection attempt (TCP SYN)
while its own outbound connections work, as behind NAT. The nodes' memory caps make a 2-stage
plan, so one data link must reach ``walled``: it goes through the relay, mutually authenticated
end to end, and the mesh answers as one process does. Needs root, ``ip`` and ``iptables``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from seamline.app import LocalModel
from seamline.server.demo import memory_cap_gb
from tests.support.mesh_harness import seamline_cmd

NS_OPEN, NS_WALLED = "slrelay1", "slrelay2"
ADDRESS_OPEN, ADDRESS_WALLED = "10.79.0.1", "10.79.0.2"
CONTEXT = 1024
QUESTION = "Name three rivers in Europe and one fact about each."
IPTABLES = shutil.which("iptables-legacy") or shutil.which("iptables")


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True)


def _down() -> None:
    for ns in (NS_OPEN, NS_WALLED):
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


@pytest.fixture(scope="module")
def namespaces() -> Iterator[None]:
    if os.geteuid() != 0 or shutil.which("ip") is None or IPTABLES is None:
        pytest.skip(
            "needs root, iproute2 and iptables (install.sh --test installs them where it can)"
        )
    _down()
    try:
        for ns in (NS_OPEN, NS_WALLED):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run(
            "ip",
            "link",
            "add",
            "slrelay-a",
            "netns",
            NS_OPEN,
            "type",
            "veth",
            "peer",
            "name",
            "slrelay-b",
            "netns",
            NS_WALLED,
        )
        for ns, dev, address in (
            (NS_OPEN, "slrelay-a", ADDRESS_OPEN),
            (NS_WALLED, "slrelay-b", ADDRESS_WALLED),
        ):
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
        # behind NAT: no connection attempt reaches it, its own connections (and replies) do
        _run(
            "ip",
            "netns",
            "exec",
            NS_WALLED,
            IPTABLES,
            "-A",
            "INPUT",
            "-i",
            "slrelay-b",
            "-p",
            "tcp",
            "--syn",
            "-j",
            "DROP",
        )
    except subprocess.CalledProcessError as exc:
        _down()
        pytest.skip(
            f"cannot make network namespaces here: {exc.stderr.decode(errors='replace').strip()}"
        )
    yield
    _down()


def _in(
    ns: str, args: list[str], env: dict[str, str], log: Path | None = None
) -> subprocess.Popen[str]:
    """A process in namespace ``ns``; its output to ``log``, or to a pipe the caller reads."""
    out = log.open("w") if log is not None else subprocess.PIPE
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *args], env=env, stdout=out, stderr=subprocess.STDOUT, text=True
    )


def _ask(question: str, port: int) -> dict:
    """The API's answer, asked from inside the first namespace (where the API listens)."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 24,
    }
    code = (
        f"import httpx, json; r = httpx.post('http://{ADDRESS_OPEN}:{port}/v1/chat/completions', "
        f"json={body!r}, timeout=300); print(json.dumps(r.json()))"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", NS_OPEN, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def _status(port: int) -> dict:
    code = f"import httpx; print(httpx.get('http://{ADDRESS_OPEN}:{port}/api/status', timeout=30).text)"
    out = subprocess.run(
        ["ip", "netns", "exec", NS_OPEN, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return dict(json.loads(out.stdout)) if out.returncode == 0 and out.stdout.strip() else {}


def test_a_node_behind_a_firewall_serves_through_the_relay(
    namespaces: None, tmp_path: Path
) -> None:
    port, control = 28301, 28302
    env = {**os.environ, "SEAMLINE_CACHE": str(tmp_path / "coordinator")}
    serve = _in(
        NS_OPEN,
        seamline_cmd(
            "serve",
            "--host",
            ADDRESS_OPEN,
            "--port",
            str(port),
            "--control-port",
            str(control),
            "--no-local-node",
            "--nodes-expected",
            "2",
            "--context",
            str(CONTEXT),
            "--precision",
            "exact",
        ),
        env,
    )
    procs = [serve]
    try:
        token = _token(serve)
        cap = f"{memory_cap_gb(None, 2, CONTEXT):.3f}"
        for ns, node in ((NS_OPEN, "open"), (NS_WALLED, "walled")):
            node_env = {
                **os.environ,
                "SEAMLINE_CACHE": str(tmp_path / node),
                "SEAMLINE_INVITE": token,
            }
            procs.append(
                _in(
                    ns,
                    seamline_cmd(
                        "join", "--node-id", node, "--quiet", "--no-progress", "--max-memory", cap
                    ),
                    node_env,
                    tmp_path / f"{node}.log",
                )
            )
        status = _wait_ready(port)
        assert len(status["stages"]) == 2, status
        nodes = {n["node_id"]: n for n in status["nodes"]}
        assert nodes["walled"]["relayed"] and not nodes["open"]["relayed"], nodes
        assert status["relayed_links"] == 1, status  # the one data link that reaches "walled"
        assert nodes["walled"]["rtt_ms"] is not None and nodes["walled"]["bandwidth_mb_s"] > 0
        (pair,) = status[
            "links"
        ]  # measured by the nodes through the relay, as their data link goes
        assert (
            sorted(pair["nodes"]) == ["open", "walled"] and pair["relayed"] and pair["rtt_ms"] > 0
        ), pair
        model = LocalModel.load(context=CONTEXT)
        ids = model.codec.encode_chat([{"role": "user", "content": QUESTION}])
        from seamline.params import SamplingParams

        expected = model.codec.decode(
            list(
                model.engine.generate(
                    ids, SamplingParams(max_tokens=24, stop_token_ids=model.codec.stop_ids)
                )
            )
        )
        assert _ask(QUESTION, port)["choices"][0]["message"]["content"] == expected
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _token(serve: subprocess.Popen[str]) -> str:
    assert serve.stdout is not None
    deadline = time.monotonic() + 180
    for line in serve.stdout:
        found = re.search(r"invite token .*: (seamline-\S+)", line)
        if found:  # from here on its output only needs draining
            threading.Thread(target=lambda: [None for _ in serve.stdout], daemon=True).start()  # type: ignore[union-attr]
            return found.group(1)
        assert time.monotonic() < deadline, "serve printed no invite"
    raise AssertionError(f"serve exited: {serve.wait()}")


def _wait_ready(port: int, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _status(port)
        if status.get("ready"):
            return status
        time.sleep(1.0)
    raise AssertionError(f"the mesh did not get ready: {_status(port)}")
