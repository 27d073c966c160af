#!/usr/bin/env bash
# Every GPU check in one call, for a machine with a CUDA device and a CUDA build of torch already
# installed (the device tool's H200 image has one): the CUDA tests (skipped on CPU-only CI), then
# `cpattn bench graph`, whose CUDA section (CUDA graphs vs eager, batch 1/8/32) runs when a GPU is
# present. Logs and JSON go to $OUT (the device tool brings that folder back), else /tmp.
# Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' || exit 1
python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_attention_op.py tests/test_dcp_ops.py tests/test_graphs.py \
  2>&1 | tee "$out/cuda_tests.log"
rc=${PIPESTATUS[0]}
python3 -m cpattn.cli bench graph --json "$out/bench_graph.json" 2>&1 | tee "$out/bench_graph.log"
exit "$rc"
