"""Speculation as a user meets it: ``serve --single`` speculates by default (``auto``), and the
real openai client gets the answers a server started with ``--speculative off`` gives, greedy
and seeded, streamed and not, at the default precision; ``/metrics`` shows the windows, the
drafts and the acceptance. Bad options are one clear line before anything loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.api import client_for, start_server, stop_server
from tests.support.cli import assert_clean_error, seamline

LIST = [
    {
        "role": "user",
        "content": "Repeat this list exactly, twice: apples, pears, plums, cherries, figs, dates.",
    }
]
ASKS = [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=5)]


def _answers(url: str) -> list[str]:
    client = client_for(url)
    answers = []
    for ask in ASKS:
        reply = client.chat.completions.create(model="default", messages=LIST, max_tokens=64, **ask)  # type: ignore[arg-type]
        answers.append(reply.choices[0].message.content or "")
        stream = client.chat.completions.create(
            model="default", messages=LIST, max_tokens=64, stream=True, **ask
        )  # type: ignore[arg-type]
        answers.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return answers


def _metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not in /metrics:\n{text}"
    return values[0]


def test_the_default_server_speculates_and_answers_as_one_that_does_not(tmp_path: Path) -> None:
    fast = ("--precision", "fast")
    plain_proc, plain_url = start_server(tmp_path / "off", *fast, "--speculative", "off")
    try:
        plain = _answers(plain_url)
    finally:
        stop_server(plain_proc)
    proc, url = start_server(tmp_path / "auto", *fast)
    try:
        drafted = _answers(url)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        stop_server(proc)
    assert drafted == plain and all(plain), (drafted, plain)
    assert _metric(metrics, "seamline_speculative_windows_total") > 0
    accepted = _metric(metrics, "seamline_speculative_accepted_tokens_total")
    assert 0 < accepted <= _metric(metrics, "seamline_speculative_draft_tokens_total")
    assert 0 < _metric(metrics, "seamline_speculative_acceptance") <= 1
    assert _metric(metrics, "seamline_speculative_tokens_per_window") > 1


def test_bad_speculation_options_are_one_line() -> None:
    assert_clean_error(seamline("run", "-p", "hi", "--draft-max", "0"), "--draft-max 0")
    assert_clean_error(
        seamline("serve", "--speculative", "ngram", "--private", "--port", "1"),
        "not with --private",
    )
    bad = subprocess.run(
        [sys.executable, "-m", "seamline.cli", "run", "-p", "hi", "--speculative", "sometimes"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--speculative" in bad.stderr and "Traceback" not in bad.stderr
