"""`seamline status URL`: the console's summary in the terminal, from ``/api/status`` and
``/metrics`` (a single-process server has only the latter)."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from seamline.errors import SeamlineError


def fetch_summary(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(
        base_url=url.rstrip("/"), headers=headers, timeout=timeout_s, verify=False
    ) as client:
        metrics = _metrics(_get(client, "/metrics").text)
        reply = client.get("/api/status")
        status = reply.json() if reply.status_code == 200 else None
    return summary(status, metrics)


def _get(client: httpx.Client, path: str) -> httpx.Response:
    try:
        reply = client.get(path)
    except httpx.HTTPError as exc:
        raise SeamlineError(f"cannot reach {client.base_url}{path}: {exc}") from None
    if reply.status_code != 200:
        raise SeamlineError(
            f"{client.base_url}{path} answered {reply.status_code}: {reply.text[:200]}"
        )
    return reply


def _metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def summary(
    status: dict[str, Any] | None, metrics: dict[str, list[tuple[dict[str, str], float]]]
) -> str:
    one = lambda name: sum(v for _, v in metrics.get(name, []))  # noqa: E731
    lines = []
    if status is not None:
        state = "serving" if status.get("ready") else status.get("state", "?")
        lines.append(f"model {status.get('model')}: {state}, plan {status.get('plan_id')}")
    lines.append(
        f"requests: {one('seamline_requests_running'):.0f} running, {one('seamline_requests_waiting'):.0f} "
        f"waiting; {one('seamline_generation_tokens_total'):.0f} tokens generated"
    )
    layers = {r: s["layers"] for s in (status or {}).get("stages", []) for r in s["ranks"]}
    steps = {labels["node"]: v for labels, v in metrics.get("seamline_node_step_seconds", [])}
    loading = {
        n["node_id"]: n["downloading"]
        for n in (status or {}).get("nodes", [])
        if n.get("downloading")
    }
    for labels, up in metrics.get("seamline_node_up", []):
        node = labels["node"]
        where = f"layers [{layers[node][0]}, {layers[node][1]})" if node in layers else ""
        step = f"step {steps[node] * 1e3:.1f} ms" if node in steps else ""
        fetch = _downloading(loading[node]) if node in loading else ""
        lines.append(
            "  ".join(p for p in (f"node {node}", "up" if up else "down", where, step, fetch) if p)
        )
    for event in (status or {}).get("events", [])[-5:]:
        lines.append(f"event: {event['message']}")
    return "\n".join(lines)


def _downloading(progress: dict[str, int]) -> str:
    done, total = progress["bytes_done"], progress["bytes_total"]
    return f"downloading {done / 2**20:.1f} of {total / 2**20:.1f} MiB ({100 * done // max(total, 1)}%)"
