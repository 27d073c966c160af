"""Benchmark: DistGroup collective algorithms, "native" vs "a2a", side by side on gloo.

For each collective of :class:`cpattn.comm.Group` (all_gather,
reduce_scatter, all_reduce) and message sizes from decode-step scale (a few
KiB) to prefill scale (MiBs), every rank times the backend's own algorithm
and the one built from a single ``all_to_all_single`` (see
:mod:`cpattn.comm.dist`; forced here at every size, so the table shows where
gloo's own algorithms catch up, which is what ``SMALL_BYTES`` is set from),
alternating the two so drift in machine load hits both alike, and checks
that they agree. ``ratio = native / a2a`` (> 1: a2a is faster). all_to_all
itself is the same call under both: its ratio shows the run's noise.

Usage::

    cpattn bench comm                 # 2 gloo ranks x 1 thread
    cpattn bench comm --quick         # decode-sized messages only, a few seconds
    cpattn bench comm --ranks 4 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpattn.bench.common import back_to_back, table, write_json
from cpattn.comm.dist import DistGroup
from cpattn.comm.launch import spawn

SIZES = [4 << 10, 32 << 10, 256 << 10, 2 << 20, 8 << 20]  # bytes per rank's input (float32)
KINDS = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


def bench_rank(group, sizes, reps):
    """Rank function: time native vs a2a for every kind and size; returns rows (rank 0's are printed)."""
    groups = {"native": DistGroup(algorithm="native"), "a2a": DistGroup(algorithm="a2a", small_bytes=1 << 62)}
    once = back_to_back(group)
    gen = torch.Generator().manual_seed(group.rank)
    rows = []
    for nbytes in sizes:
        x = torch.randn(group.size, nbytes // 4 // group.size, generator=gen)  # dim 0 divisible by N
        for kind in KINDS:
            calls = {algo: (lambda g=g: getattr(g, kind)(x)) for algo, g in groups.items()}
            diff = (calls["native"]() - calls["a2a"]()).abs().max().item()
            times = {algo: [] for algo in calls}
            for _ in range(reps):
                for algo, fn in calls.items():
                    times[algo].append(once(fn))
            nat, a2a = (statistics.median(times[a]) for a in ("native", "a2a"))
            rows.append({"bytes": nbytes, "collective": kind, "native_ms": 1e3 * nat, "a2a_ms": 1e3 * a2a,
                         "ratio": nat / a2a, "max_abs_diff": diff})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cpattn bench comm", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 KiB and 32 KiB messages only")
    ap.add_argument("--ranks", type=int, default=2, help="gloo processes (one thread each)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES,
                    help="input bytes per rank, comma-separated")
    ap.add_argument("--json", default=None, help="write results as JSON here ('-' for stdout)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = SIZES[:2]
    t0 = time.perf_counter()
    res = spawn(args.ranks, bench_rank, args.sizes, args.reps, threads=1, timeout_s=900)
    print(f"gloo, {args.ranks} ranks x 1 thread, median of {args.reps} samples of 5 back-to-back calls "
          f"(run {time.perf_counter() - t0:.0f} s)")
    print(table(res[0], ["bytes", "collective", "native_ms", "a2a_ms", "ratio", "max_abs_diff"]))
    write_json(args.json, {"config": vars(args), "rows": res[0]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
