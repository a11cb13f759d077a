"""Prometheus metrics (``GET /metrics``): what the API serves, and what the nodes report.

Request metrics are taken where requests are answered, so one process and a mesh count alike:
tokens generated and prompt tokens taken, requests by how they ended (``status``: the finish
reason ``stop`` / ``length``, or ``error``, or ``abort`` when the client went away), the
requests running (a token came) and waiting (admitted, no token yet: queued or in prefill),
time to first token and the gaps between tokens. Node and link figures are asked of the
backend (``Backend.report``) at each scrape: whether a node serves, its mean decode step, the
KV cache bytes it holds, each measured link's round trip and the bytes its data links carried,
and where the backend speculates, its windows, drafts and accepted drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from seamline.runtime.reports import MeshReport
from seamline.runtime.speculation import SpeculationStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


Reporter = Callable[[], MeshReport]


class Metrics:
    def __init__(self, report: Reporter | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.generation_tokens = Counter(
            "seamline_generation_tokens", "Tokens generated", registry=r
        )
        self.prompt_tokens = Counter(
            "seamline_prompt_tokens", "Prompt tokens of the requests taken", registry=r
        )
        self.requests = Counter(
            "seamline_requests", "Requests by how they ended", ["status"], registry=r
        )
        self.running = Gauge(
            "seamline_requests_running", "Requests generating (a token came)", registry=r
        )
        self.waiting = Gauge(
            "seamline_requests_waiting", "Requests admitted with no token yet", registry=r
        )
        self.ttft = Histogram(
            "seamline_time_to_first_token_seconds",
            "From the request to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "seamline_inter_token_latency_seconds",
            "Between a request's tokens",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        if report is not None:
            r.register(_MeshCollector(report))

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestMeter:
    """One choice's life: waiting until its first token, then running, then ended once."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.started = self.last = time.monotonic()
        self.tokens = 0
        self.ended = False
        metrics.waiting.inc()

    def token(self) -> None:
        now, m = time.monotonic(), self.metrics
        if self.tokens == 0:
            m.ttft.observe(now - self.started)
            m.waiting.dec()
            m.running.inc()
        else:
            m.itl.observe(now - self.last)
        self.tokens += 1
        self.last = now
        m.generation_tokens.inc()

    def end(self, status: str) -> None:
        if self.ended:
            return
        self.ended = True
        (self.metrics.running if self.tokens else self.metrics.waiting).dec()
        self.metrics.requests.labels(status=status).inc()


class _MeshCollector(Collector):
    """Asks the backend for its nodes and links at each scrape."""

    def __init__(self, report: Reporter) -> None:
        self.report = report

    def collect(self) -> Iterator[Metric]:
        report = self.report()
        up = GaugeMetricFamily(
            "seamline_node_up", "1: the node serves in the current plan", labels=["node"]
        )
        step = GaugeMetricFamily(
            "seamline_node_step_seconds", "Mean decode step of the node", labels=["node"]
        )
        kv = GaugeMetricFamily(
            "seamline_node_kv_used_bytes", "KV cache bytes the node holds", labels=["node"]
        )
        for node in report.nodes:
            up.add_metric([node.node], 1.0 if node.up else 0.0)
            if node.step_seconds is not None:
                step.add_metric([node.node], node.step_seconds)
            if node.kv_used_bytes is not None:
                kv.add_metric([node.node], node.kv_used_bytes)
        rtt = GaugeMetricFamily(
            "seamline_link_rtt_seconds", "Measured round trip", labels=["src", "dst"]
        )
        sent = CounterMetricFamily(
            "seamline_link_bytes", "Bytes sent over the link", labels=["src", "dst"]
        )
        for link in report.links:
            if link.rtt_seconds is not None:
                rtt.add_metric([link.src, link.dst], link.rtt_seconds)
            if link.bytes_total is not None:
                sent.add_metric([link.src, link.dst], link.bytes_total)
        events = CounterMetricFamily(
            "seamline_mesh_events",
            "The mesh's events so far (nodes joining and "
            "leaving, plans, routes published, requests replayed)",
            labels=["kind"],
        )
        for kind, count in sorted(report.events.items()):
            events.add_metric([kind], count)
        yield from (up, step, kv, rtt, sent, events)
        if report.speculation is not None:
            yield from _speculation_metrics(report.speculation)


def _speculation_metrics(stats: SpeculationStats) -> Iterator[Metric]:
    """Windows verified, drafts made and accepted; the acceptance and tokens per window so far."""
    yield CounterMetricFamily(
        "seamline_speculative_windows", "Speculative windows verified", value=stats.windows
    )
    yield CounterMetricFamily(
        "seamline_speculative_draft_tokens", "Tokens drafted", value=stats.drafted
    )
    yield CounterMetricFamily(
        "seamline_speculative_accepted_tokens", "Drafted tokens accepted", value=stats.accepted
    )
    if stats.acceptance is not None and stats.tokens_per_window is not None:
        yield GaugeMetricFamily(
            "seamline_speculative_acceptance",
            "Drafted tokens accepted / drafted",
            value=stats.acceptance,
        )
        yield GaugeMetricFamily(
            "seamline_speculative_tokens_per_window",
            "Tokens a window gave (accepted drafts and the token drawn after them)",
            value=stats.tokens_per_window,
        )
