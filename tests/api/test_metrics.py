"""`GET /metrics` in Prometheus' text format, parsed by prometheus-client's own parser: the
counters move by exactly the tokens a request generated and took, for one process (the real
openai client against a real server) and for a 2-node mesh, whose nodes and links are listed
and whose killed node reads down."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from seamline.app import LocalModel
from seamline.runtime.backend import LocalBackend
from tests.support.api import NAME, QUESTION, client_for, serve
from tests.support.mesh import start_mesh
from tests.support.mesh_harness import seamline_cmd

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    reply = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_one_process_counts_what_it_served() -> None:
    model = LocalModel.load()
    with serve(LocalBackend(model.engine, model.codec, NAME)) as url:
        client = client_for(url)
        client.chat.completions.create(
            model=NAME, messages=QUESTION, max_tokens=2
        )  # every metric exists now
        before = scrape(url)
        full = {"ignore_eos": True}  # every request runs to max_tokens
        reply = client.chat.completions.create(
            model=NAME, messages=QUESTION, max_tokens=12, temperature=0, extra_body=full
        )
        stream = client.completions.create(
            model=NAME,
            prompt="The sea is",
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body=full,
        )
        streamed = sum(
            1 for chunk in stream if chunk.choices and chunk.choices[0].finish_reason is None
        )
        after = scrape(url)
    usage = reply.usage
    assert usage is not None and usage.completion_tokens == 12 and streamed >= 1
    prompt = len(model.codec.encode("The sea is"))
    assert moved(before, after, "seamline_generation_tokens_total") == 12 + 5
    assert moved(before, after, "seamline_prompt_tokens_total") == usage.prompt_tokens + prompt
    assert moved(before, after, "seamline_requests_total", status="length") == 2
    assert moved(before, after, "seamline_time_to_first_token_seconds_count") == 2
    assert moved(before, after, "seamline_inter_token_latency_seconds_count") == 11 + 4
    assert (
        value(after, "seamline_requests_running") == 0
        and value(after, "seamline_requests_waiting") == 0
    )
    assert value(after, "seamline_node_up", node="local") == 1
    assert value(after, "seamline_node_step_seconds", node="local") > 0


def test_a_mesh_lists_its_nodes_and_links_and_a_killed_node_reads_down(tmp_path: Path) -> None:
    mesh = start_mesh(tmp_path, 2, "--log-format", "json")
    try:
        first, second = (s["node_id"] for s in mesh.wait_ready()["stages"])
        before = scrape(mesh.base_url)
        body: dict[str, Any] = {
            "model": "default",
            "prompt": "The rivers of Europe",
            "temperature": 0,
            "max_tokens": 8,
            "ignore_eos": True,
        }
        assert (
            httpx.post(f"{mesh.base_url}/v1/completions", json=body, timeout=120).status_code == 200
        )
        after = scrape(mesh.base_url)
        assert moved(before, after, "seamline_generation_tokens_total") == 8
        assert moved(before, after, "seamline_requests_total", status="length") == 1
        for node in (first, second):
            assert value(after, "seamline_node_up", node=node) == 1
            assert value(after, "seamline_node_step_seconds", node=node) > 0
            assert value(after, "seamline_link_rtt_seconds", src=node, dst="coordinator") > 0
        hidden = moved(before, after, "seamline_link_bytes_total", src=first, dst=second)
        assert hidden > 8 * 576 * 4  # at least a float32 hidden state a token
        assert (
            moved(before, after, "seamline_link_bytes_total", src=second, dst=first) > 0
        )  # the tokens back
        printed = subprocess.run(
            seamline_cmd("status", mesh.base_url), capture_output=True, text=True, timeout=60
        )
        assert printed.returncode == 0, printed.stderr
        assert (
            f"node {first}  up  layers [0, " in printed.stdout
            and f"node {second}  up  layers [" in printed.stdout
        )
        records = [
            json.loads(line) for line in mesh.output if line.startswith("{")
        ]  # --log-format json
        assert any(
            r["logger"].startswith("seamline") and r["level"] == "info" and r["message"]
            for r in records
        )
        mesh.node_procs[int(second.removeprefix("node"))].kill()
        deadline = time.monotonic() + 20
        while value(scrape(mesh.base_url), "seamline_node_up", node=second) != 0:
            assert time.monotonic() < deadline, "the killed node still reads up"
            time.sleep(0.5)
    finally:
        mesh.stop()


def test_the_status_summary_shows_a_download_under_way() -> None:
    """A node still fetching its fragments (the coordinator's ``downloading``, from the node's
    progress reports) reads as such in `seamline status`."""
    from seamline.server.status_cli import summary

    status = {
        "ready": False,
        "state": "starting plan 1",
        "plan_id": 1,
        "model": "m",
        "events": [],
        "stages": [{"ranks": ["a"], "layers": [0, 30]}],
        "nodes": [
            {"node_id": "a", "downloading": {"bytes_done": 3 << 20, "bytes_total": 12 << 20}}
        ],
    }
    up = {"seamline_node_up": [({"node": "a"}, 1.0)]}
    assert "node a  up  layers [0, 30)  downloading 3.0 of 12.0 MiB (25%)" in summary(status, up)
