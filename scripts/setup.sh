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
python -c "import cpattn, torch; print(f'cpattn {cpattn.__version__} with torch {torch.__version__} ready in .venv')"
