"""Benchmark: the CPU paths of ``paged_attention_with_lse``, side by side, and which one dispatch picks.

For a grid of decode batches (query rows T, visible keys L per row, kv heads
x head dim, float32 / bfloat16) one thread times the three paths in
interleaved rounds and reports each one's best:

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
    cpattn bench paged --quick --json -
"""

from __future__ import annotations

import itertools

from cpattn.bench import harness
from cpattn.bench.harness import safe_div
from cpattn.config import cli_args as cli

# (kv heads, head dim, query heads per kv head, block size): GQA 8 x 128, small GQA, MQA, MLA latent
HEADS = [(8, 128, 4, 128), (2, 32, 4, 16), (1, 32, 4, 16), (1, 576, 16, 64)]
ROWS = [1, 8, 64]
KEYS = [256, 2048]
MAX_ELEMS = 1 << 23  # skip shapes whose gathered keys exceed this (the small path would take seconds)


def _case(hkv, d, g, bs, t, keys, dtype):
    import torch

    w = keys // bs
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(t * w, bs, hkv, d, generator=gen).to(dtype)
    v_cache = k_cache[..., :512] if d == 576 else torch.randn(t * w, bs, hkv, d, generator=gen).to(dtype)
    table_ = torch.arange(t * w).view(t, w)
    q = torch.randn(t, hkv * g, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, table_, torch.arange(t), torch.full((t,), keys)


def run(dtypes, heads, rows, keys, reps):
    """Time every path on every shape of the grid; returns table rows."""
    import torch
    from cpattn.ops import paged

    out = []
    for dtype, (hkv, d, g, bs), t, n in itertools.product(dtypes, heads, rows, keys):
        if t * n * hkv * d > MAX_ELEMS:
            continue
        args = _case(hkv, d, g, bs, t, n, dtype)
        scale = d**-0.5
        torch._dynamo.reset()
        compiled = torch.compile(paged._paged_traced, backend="inductor", fullgraph=True, dynamic=False)

        def flash(args=args, scale=scale):
            with_limits = (paged.SMALL_ELEMS, paged.SMALL_ROW_ELEMS)
            paged.SMALL_ELEMS = -1  # the kernel's flash loop
            try:
                return paged._paged_cpu(*args, scale)
            finally:
                paged.SMALL_ELEMS, paged.SMALL_ROW_ELEMS = with_limits

        s = harness.compare({"small": lambda: paged._paged_small(*args, scale), "flash": flash,
                             "traced": lambda: compiled(*args, scale)}, reps, warmup=1).samples
        small, flash_ms, traced = (1e3 * s[k].best for k in ("small", "flash", "traced"))
        eager_pick = "small" if paged._small(args[0], args[1], args[2], n) else "flash"
        graph_pick = "traced" if paged._traceable(*args) else "op"
        eager_ms = small if eager_pick == "small" else flash_ms
        graph_ms = traced if graph_pick == "traced" else eager_ms  # an opaque op runs the eager kernel
        out.append({
            "dtype": str(dtype).removeprefix("torch."), "hkv x d": f"{hkv} x {d}", "T": t, "L": n,
            "small_ms": small, "flash_ms": flash_ms, "traced_ms": traced,
            "eager_pick": eager_pick, "graph_pick": graph_pick,
            "eager_vs_best": safe_div(eager_ms, min(small, flash_ms)),
            "graph_vs_best": safe_div(graph_ms, min(traced, eager_ms)),
        })
    return out


COLUMNS = ["dtype", "hkv x d", "T", "L", "small_ms", "flash_ms", "traced_ms", "eager_pick", "eager_vs_best",
           "graph_pick", "graph_vs_best"]


def main(argv=None) -> int:
    """``cpattn bench paged``: time every CPU path of paged attention and name dispatch's pick."""
    ap = harness.parser("cpattn bench paged", __doc__, quick="float32, two head shapes, T in {1, 8}, L in {256, 2048}")
    ap.add_argument("--reps", type=cli.positive_int, default=5, help="interleaved rounds per shape (best is shown)")
    args = ap.parse_args(argv)
    import torch
    from cpattn.ops import paged

    torch.set_num_threads(1)
    dtypes, heads, rows = [torch.float32, torch.bfloat16], HEADS, ROWS
    if args.quick:
        dtypes, heads, rows = [torch.float32], HEADS[:2], ROWS[:2]
    with harness.Report(args) as out:
        out.progress(f"up to {len(dtypes) * len(heads) * len(rows) * len(KEYS)} shapes, each compiled once")
        res = run(dtypes, heads, rows, KEYS, args.reps)
        out.line(f"paged_attention_with_lse on the CPU, 1 thread, best of {args.reps} interleaved rounds; SMALL_ELEMS "
                 f"= {paged.SMALL_ELEMS}, SMALL_ROW_ELEMS = {paged.SMALL_ROW_ELEMS} (run {out.elapsed:.0f} s)")
        out.table(res, COLUMNS)
        out.line("*_vs_best: time of the path picked / the fastest candidate (eager: small or flash; graph: traced or "
                 "the op)")
        out.payload = {"config": {**vars(args), "SMALL_ELEMS": paged.SMALL_ELEMS,
                                  "SMALL_ROW_ELEMS": paged.SMALL_ROW_ELEMS}, "rows": res}
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
