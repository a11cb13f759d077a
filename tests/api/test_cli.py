"""The command line as a user runs it: real processes, one-line errors, no tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from seamline.app import LocalModel, default_model_path
from tests.support.cli import assert_clean_error, seamline
from tests.support.mesh import expected_forked_text, expected_text

QUESTION = "List three prime numbers."

# these answers are the float32 path's: with int8 activation blocks (the default) the embedded
# model's first token for the capital of France is a near tie ("The" 25.33, "L" 25.24) that flips
EXACT = ("--precision", "exact")


def test_run_answers_paris() -> None:
    proc = seamline("run", "-p", "What is the capital of France?", "--max-tokens", "32", *EXACT)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_run_with_explicit_gguf_and_stop_string() -> None:
    proc = seamline(
        "run",
        "--model",
        str(default_model_path()),
        "-p",
        "What is the capital of France?",
        "--stop",
        "Paris",
        "--max-tokens",
        "32",
        *EXACT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" not in proc.stdout and "France" in proc.stdout


def test_interactive_chat_keeps_history() -> None:
    proc = seamline(
        "run", "--max-tokens", "24", *EXACT, stdin="What is the capital of France?\n/exit\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_missing_model_path(tmp_path: Path) -> None:
    assert_clean_error(
        seamline("run", "--model", str(tmp_path / "nope"), "-p", "hi"), "does not exist"
    )


def test_folder_without_config(tmp_path: Path) -> None:
    assert_clean_error(seamline("run", "--model", str(tmp_path), "-p", "hi"), "has no config.json")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(default_model_path().read_bytes()[:100_000])
    assert_clean_error(seamline("run", "--model", str(bad), "-p", "hi"), "bad.gguf")


def test_prompt_longer_than_context() -> None:
    proc = seamline("run", "--context", "16", "-p", "word " * 40)
    assert_clean_error(proc, "context is 16")


@pytest.mark.parametrize("flag", [["--temperature", "-1"], ["--top-p", "0"], ["--max-tokens", "0"]])
def test_bad_sampling_flags(flag: list[str]) -> None:
    assert_clean_error(seamline("run", "-p", "hi", *flag), "must be")


def test_serve_refuses_a_group_size_the_model_does_not_divide_into(tmp_path: Path) -> None:
    # the embedded model's 1536 feed-forward rows do not divide by 5; refused before packaging
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "seamline.cli",
            "serve",
            "--tensor-parallel-size",
            "5",
            "--no-local-node",
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SEAMLINE_CACHE": str(tmp_path)},
    )
    assert_clean_error(proc, "1536 feed-forward rows do not divide among 5 ranks")
    assert not (tmp_path / "packages").exists()


def test_serve_single_answers_concurrent_clients() -> None:
    """`seamline serve --single`: one process, the OpenAI API, several clients at once."""
    import threading

    import httpx
    import openai

    from tests.support.api import bind_free_port

    probe = bind_free_port()
    port = probe.getsockname()[1]
    probe.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "seamline.cli", "serve", "--single", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        printed = ""
        while "seamline: serving" not in printed:  # a user reads the address, then uses it at once
            line = proc.stderr.readline()
            assert line, f"serve --single exited before it said where it serves:\n{printed}"
            printed += line
        assert f"http://127.0.0.1:{port}/v1" in printed, printed
        assert (
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        )  # no retry
        threading.Thread(
            target=proc.stderr.read, daemon=True
        ).start()  # keep its log from filling the pipe
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        answers: list[str] = []

        def ask() -> None:
            reply = client.chat.completions.create(
                model="default",
                temperature=0,
                max_tokens=16,
                messages=[{"role": "user", "content": QUESTION}],
            )
            answers.append(reply.choices[0].message.content or "")

        threads = [threading.Thread(target=ask) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        # the default (fast) precision's greedy answer as this machine computes it in one process
        # (int8 blocks with AVX-512 VNNI, bfloat16 elsewhere: the words differ between the two):
        # alone, or, for a client whose request came while another's same prompt ran, forked
        # from that one's cache (its last prompt position computed as a one-row step)
        local = LocalModel.load(precision="fast")
        want = {expected_text(local, QUESTION, 16), expected_forked_text(local, QUESTION, 16)}
        assert len(answers) == 3 and set(answers) <= want, (answers, want)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_join_reads_its_invite_from_one_place(tmp_path: Path) -> None:
    """`join` takes the invite from its argument, --token-file or $SEAMLINE_INVITE: none, or
    two of them, is a clear error; a file's token is read (this one is corrupt, and says so)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "SEAMLINE_INVITE"}

    def join(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "seamline.cli", "join", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, **extra},
        )

    assert_clean_error(join(), "give the invite token once")
    assert_clean_error(
        join("seamline-abc", SEAMLINE_INVITE="seamline-def"),
        "the command line and $SEAMLINE_INVITE",
    )
    token_file = tmp_path / "invite.txt"
    token_file.write_text("seamline-not-a-real-token\n")
    assert_clean_error(join("--token-file", str(token_file)), "corrupt")
    assert_clean_error(join(SEAMLINE_INVITE="seamline-not-a-real-token"), "corrupt")
    assert_clean_error(
        join("--token-file", str(tmp_path / "missing")), "cannot read the invite token file"
    )


def test_bench_without_its_extras_says_how_to_install_them() -> None:
    """A server installed without the benchmarks' extras (./install.sh): `seamline bench` names
    the missing client and the command that installs it, in one line, before it starts anything."""
    hide_openai = (
        "import sys; sys.modules['openai'] = None; from seamline.cli import main; sys.exit(main())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", hide_openai, "bench", "throughput"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_clean_error(proc, "the benchmarks need openai")
    assert "./install.sh --bench" in proc.stderr
