#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the CPU with its embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
cpattn demo "$@"
