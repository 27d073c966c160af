#!/usr/bin/env bash
# Set up cpattn in ./.venv: torch (CPU build 2.13.0 if no torch is there yet), then cpattn[dev], editable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# a bare `pip install torch` would pull a multi-GB CUDA build: pin the CPU build when torch is absent
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# Mooncake's Python module links libibverbs.so.1 even for TCP: install Debian's libibverbs1 when we can (root,
# apt). Never fail set-up over it: without it the Mooncake pool tests skip and say why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null; then
  { export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq libibverbs1 || { apt-get update -qq && apt-get install -y -qq libibverbs1; }; } \
    >/dev/null 2>&1 || echo "setup.sh: could not install libibverbs1; the Mooncake pool tests will skip" >&2
fi
python -c "import cpattn, torch; print(f'cpattn {cpattn.__version__} with torch {torch.__version__} ready in .venv')"
