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

Each cell is the median of ``--reps`` interleaved samples (a sample is
``--inner`` back-to-back calls, started together on a barrier, the slowest
rank's time); ``ratio`` is the median of the per-sample ratios with their
low-high range, so a reader sees what is noise: compare the all_to_all
control row's range with the others.

Usage::

    cpattn bench comm                       # 2 gloo ranks x 1 thread
    cpattn bench comm --quick               # decode-sized messages only, a few seconds
    cpattn bench comm --world-size 4 --json out.json
"""

from __future__ import annotations

from cpattn.bench import harness
from cpattn.config import cli_args as cli

SIZES = (4 << 10, 32 << 10, 256 << 10, 2 << 20, 8 << 20)  # bytes per rank's input (float32)
KINDS = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
COLUMNS = ["bytes", "collective", "native_ms", "a2a_ms", "ratio [low-high]", "max_abs_diff"]


def bench_rank(group, sizes, reps, inner=5):
    """Rank function: time native vs a2a for every kind and size; returns rows (rank 0's are printed)."""
    import torch
    from cpattn.comm.dist import DistGroup

    groups = {"native": DistGroup(algorithm="native"), "a2a": DistGroup(algorithm="a2a", small_bytes=1 << 62)}
    gen = torch.Generator().manual_seed(group.rank)
    rows = []
    for nbytes in sizes:
        x = torch.randn(group.size, max(nbytes // 4 // group.size, 1), generator=gen)  # dim 0 divisible by N
        for kind in KINDS:
            calls = {algo: (lambda g=g: getattr(g, kind)(x)) for algo, g in groups.items()}
            diff = (calls["native"]() - calls["a2a"]()).abs().max().item()
            c = harness.compare(calls, reps, group=group, inner=inner)
            r = c.ratio("native", "a2a")
            rows.append({"bytes": nbytes, "collective": kind, "native_ms": 1e3 * c.samples["native"].median,
                         "a2a_ms": 1e3 * c.samples["a2a"].median, "ratio": r.median, "ratio_low": r.low,
                         "ratio_high": r.high, "ratio_best": r.best, "max_abs_diff": diff})
    return rows


def main(argv=None) -> int:
    """``cpattn bench comm``: print native vs a2a per collective and size; JSON with ``--json``."""
    p = harness.parser("cpattn bench comm", __doc__, quick="4 KiB and 32 KiB messages only", timeout=True)
    p.add_argument("--world-size", type=cli.positive_int, default=2, metavar="N",
                   help="gloo processes, one thread each (these ranks have no parallel role)")
    p.add_argument("--reps", type=cli.positive_int, default=15, help="interleaved samples per cell")
    p.add_argument("--inner", type=cli.positive_int, default=5, help="back-to-back calls per sample")
    p.add_argument("--sizes", type=cli.int_list, default=",".join(map(str, SIZES)), metavar="BYTES,...",
                   help="input bytes per rank, comma-separated")
    args = p.parse_args(argv)
    if args.world_size < 2:
        cli.bad_value(p.prog, "--world-size", args.world_size, "at least 2 ranks (a collective needs peers)",
                      "pass --world-size 2 or more")
    if args.quick:
        args.sizes = SIZES[:2]
    with harness.Report(args) as out:
        res = harness.ranks(args.world_size, bench_rank, args.sizes, args.reps, args.inner, timeout_s=args.timeout,
                            label="native vs a2a collectives")
        out.line(f"gloo, {args.world_size} ranks x 1 thread; each cell the median of {args.reps} interleaved samples "
                 f"of {args.inner} back-to-back calls (slowest rank); ratio = native / a2a (> 1: a2a faster), median "
                 f"[low-high] of per-sample ratios (run {out.elapsed:.0f} s)")
        out.table([{**r, "ratio [low-high]": f"{r['ratio']:.3g} [{r['ratio_low']:.3g}-{r['ratio_high']:.3g}]"}
                   for r in res[0]], COLUMNS)
        out.payload = {"config": vars(args), "rows": res[0]}
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
