"""Benchmark: the CPU paths of ``paged_attention_with_lse``, side by side, and which one dispatch picks.

For a grid of decode batches (query rows T, visible keys L per row, kv heads
x head dim, float32 / bfloat16) one thread times, best of several calls:

- ``small_ms``: the batched small path (one gather of every row's keys, two
  batched matmuls), eager;
- ``flash_ms``: the per-request loop over chunks with aten's CPU flash
  kernel, eager;
- ``traced_ms``: the op's CPU decomposition compiled by inductor
  (``torch.compile(fullgraph=True)``), as inside a captured CPU program;
- ``eager_pick`` / ``graph_pick``: what the eager kernel and a compiled
  program choose for that shape (``SMALL_ELEMS``, ``SMALL_ROW_ELEMS`` in
  :mod:`cpattn.ops.paged`), and ``pick_vs_best``: the time of the path
  picked over the fastest of its candidates (1.00 = the right choice).

Usage::

    cpattn bench paged            # the full grid (~2 min)
    cpattn bench paged --quick    # float32, four shapes
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from cpattn.bench.common import table, write_json
from cpattn.ops import paged
from cpattn.ops.paged import paged_attention_with_lse

# (kv heads, head dim, query heads per kv head, block size): GQA 8 x 128, small GQA, MQA, MLA latent
HEADS = [(8, 128, 4, 128), (2, 32, 4, 16), (1, 32, 4, 16), (1, 576, 16, 64)]
ROWS = [1, 8, 64]
KEYS = [256, 2048]
MAX_ELEMS = 1 << 23  # skip shapes whose gathered keys exceed this (the small path would take seconds)


def _best(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def _case(hkv, d, g, bs, t, keys, dtype):
    w = keys // bs
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(t * w, bs, hkv, d, generator=gen).to(dtype)
    v_cache = k_cache[..., :512] if d == 576 else torch.randn(t * w, bs, hkv, d, generator=gen).to(dtype)
    table_ = torch.arange(t * w).view(t, w)
    q = torch.randn(t, hkv * g, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, table_, torch.arange(t), torch.full((t,), keys)


def run(dtypes, heads, rows, keys, reps):
    """Time every path on every shape of the grid; returns table rows."""
    out = []
    for dtype, (hkv, d, g, bs), t, n in itertools.product(dtypes, heads, rows, keys):
        if t * n * hkv * d > MAX_ELEMS:
            continue
        args = _case(hkv, d, g, bs, t, n, dtype)
        scale = d**-0.5
        small = _best(lambda: paged._paged_small(*args, scale), reps)
        with_limits = (paged.SMALL_ELEMS, paged.SMALL_ROW_ELEMS)
        paged.SMALL_ELEMS = -1  # the kernel's flash loop
        try:
            flash = _best(lambda: paged._paged_cpu(*args, scale), reps)
        finally:
            paged.SMALL_ELEMS, paged.SMALL_ROW_ELEMS = with_limits
        torch._dynamo.reset()
        compiled = torch.compile(paged._paged_traced, backend="inductor", fullgraph=True, dynamic=False)
        traced = _best(lambda: compiled(*args, scale), reps)
        eager_pick = "small" if paged._small(args[0], args[1], args[2], n) else "flash"
        graph_pick = "traced" if paged._traceable(*args) else "op"
        eager_ms = small if eager_pick == "small" else flash
        graph_ms = traced if graph_pick == "traced" else eager_ms  # an opaque op runs the eager kernel
        out.append({
            "dtype": str(dtype).removeprefix("torch."), "hkv x d": f"{hkv} x {d}", "T": t, "L": n,
            "small_ms": small, "flash_ms": flash, "traced_ms": traced,
            "eager_pick": eager_pick, "graph_pick": graph_pick,
            "eager_vs_best": eager_ms / min(small, flash), "graph_vs_best": graph_ms / min(traced, eager_ms),
        })
    return out


COLUMNS = ["dtype", "hkv x d", "T", "L", "small_ms", "flash_ms", "traced_ms", "eager_pick", "eager_vs_best",
           "graph_pick", "graph_vs_best"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cpattn bench paged", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="float32, two head shapes, T in {1, 8}, L in {256, 2048}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write results as JSON here ('-' for stdout)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtypes, heads, rows = [torch.float32, torch.bfloat16], HEADS, ROWS
    if args.quick:
        dtypes, heads, rows = [torch.float32], HEADS[:2], ROWS[:2]
    t0 = time.perf_counter()
    res = run(dtypes, heads, rows, KEYS, args.reps)
    print(f"paged_attention_with_lse on the CPU, 1 thread, best of {args.reps}; SMALL_ELEMS = {paged.SMALL_ELEMS}, "
          f"SMALL_ROW_ELEMS = {paged.SMALL_ROW_ELEMS} (run {time.perf_counter() - t0:.0f} s)")
    print(table(res, COLUMNS))
    print("*_vs_best: time of the path picked / the fastest candidate (eager: small or flash; graph: traced or the op)")
    write_json(args.json, {"config": {**vars(args), "SMALL_ELEMS": paged.SMALL_ELEMS,
                                      "SMALL_ROW_ELEMS": paged.SMALL_ROW_ELEMS}, "rows": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
