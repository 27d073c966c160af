"""Malformed index arguments never crash an op: ValueError, or the float64 oracle's result.

The fuzzing runs in a subprocess (tests/fuzz_ops_worker.py), so a hard
crash -- SIGFPE from a kernel handed an empty block, SIGSEGV from an
out-of-range read -- fails this test instead of killing pytest. Hypothesis
is derandomized there: every run draws the same examples.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

EXAMPLES_PER_OP = 40
WORKER = os.path.join(os.path.dirname(__file__), "fuzz_ops_worker.py")


def test_fuzzed_ops_raise_value_error_or_match_the_oracle():
    proc = subprocess.run([sys.executable, WORKER, str(EXAMPLES_PER_OP)], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode < 0:
        raise AssertionError(f"the fuzzed ops crashed the interpreter with {signal.Signals(-proc.returncode).name}:"
                             f"\n{proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no report from the worker (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1])
    failures = {op: r["failure"] for op, r in report.items() if r["failure"]}
    assert not failures, failures
    assert proc.returncode == 0, proc.stderr[-3000:]
    for op, r in report.items():  # each op was really exercised both ways
        assert r["ok"] >= 3 and r["value_error"] >= 3, (op, r)
