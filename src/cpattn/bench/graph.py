"""Benchmark: graph-captured decode steps vs eager, side by side in one run.

The demo decode program of :mod:`cpattn.graphs.demo_program` (L layers of
rmsnorm, q/k/v projections with rope, ``write_kv``, ``dcp_decode``, output
projection with a TP all-reduce) runs on a DCP group of real gloo processes
(one thread each). For batch 1, 8 and 32 it times, on the same state:

- eager: the step function called directly on the unpadded batch;
- graph: ``DecodeRunner`` with the "cpu" backend (inductor, fullgraph, one
  program per capture size), copy into the persistent buffers included.
  Inductor traces the CPU decompositions of ``write_kv`` and
  ``paged_attention_with_lse`` (:func:`cpattn.ops.registry.decomposition`)
  and fuses them with the projections around them;
- the part no CPU graph can shorten: the step's collectives over gloo
  (``comm_ms`` = L layers of all-gather q, the merge's collectives and the
  output all-reduce, run back to back on tensors of the step's shapes);
  ``bound = eager / comm`` is the speedup if all compute were free.

Eager, graph and the collectives are timed in interleaved rounds
(:func:`cpattn.bench.harness.compare`): a sample is five back-to-back calls
started together on a barrier, the slowest rank's time, so drift in machine
load hits all alike and no barrier is charged to a step. Times are medians;
``speedup`` is the median [low-high] of the per-round eager / graph ratios,
``speedup_best`` fastest eager / fastest graph (steadier on a loaded machine).
A CUDA section (one device, DCP = 1, CUDA graphs) runs when a GPU is present.

Usage::

    cpattn bench graph              # 4 layers, batch 1/8/32, 256-token context, DCP = 2
    cpattn bench graph --quick      # 2 layers, batch 8 (one compile per rank), < 60 s
    cpattn bench graph --dcp 4 --heads 8 --json out.json
"""

from __future__ import annotations

import time

from cpattn.bench import harness
from cpattn.config import cli_args as cli
from cpattn.dcp.layer_merges import LAYER_MERGES, PROGRAM_MERGES, cli_merge


def _config(args) -> dp.ProgramConfig:
    from cpattn.graphs import demo_program as dp

    local = -(-(args.context + 1) // args.decode_context_parallel_size)  # tokens per rank per request
    max_blocks = -(-local // args.block_size) + 1
    return dp.ProgramConfig(
        num_layers=args.layers, hidden=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.head_dim, block_size=args.block_size, interleave_size=args.cp_kv_cache_interleave_size,
        max_blocks=max_blocks,
        num_blocks=max(args.batches) * max_blocks, merge=args.merge,
    )


def bench_rank(group, cfg, params, batches, context, reps, backend, device="cpu"):
    """Rank function: capture, prefill `context` tokens per request, time eager vs graph per batch size."""
    import torch
    from cpattn.graphs import DecodeRunner, demo_program as dp

    gen = torch.Generator().manual_seed(0)
    state = dp.init_state(cfg, params, group.rank, group.size, poison=0.0, device=device)
    step = dp.make_step(cfg, group)
    runner = DecodeRunner(step, state, dp.fields(cfg), capture_sizes=batches, backend=backend)
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    nreq = max(batches)
    block_table = torch.arange(nreq * cfg.max_blocks).view(nreq, cfg.max_blocks)
    for b0 in range(0, nreq, 8):  # prefill in groups of 8 requests (eager path)
        reqs = slice(b0, min(b0 + 8, nreq))
        n = reqs.stop - reqs.start
        prefill = {"x": torch.randn(n * context, cfg.hidden, generator=gen), "seq_lens": torch.full((n,), context),
                   "block_table": block_table[reqs]}
        runner(prefill, [context] * n)
    rows = []
    for b in batches:
        batch = {"x": torch.randn(b, cfg.hidden, generator=gen).to(device),
                 "seq_lens": torch.full((b,), context + 1, device=device), "block_table": block_table[:b].to(device)}
        full = {**batch, "cu_seqlens_q": torch.arange(b + 1, dtype=torch.int32, device=device)}
        fns = {"eager": lambda: step(state, full), "graph": lambda: runner(batch, [1] * b),
               "comm": _collectives(group, cfg, b, device)}
        c = harness.compare(fns, reps, group=group, inner=5, warmup=1, device=device)
        s, speedup, bound = c.samples, c.ratio("eager", "graph"), c.ratio("eager", "comm")
        rows.append({
            "batch": b, "eager_ms": 1e3 * s["eager"].median, "graph_ms": 1e3 * s["graph"].median,
            "speedup": speedup.median, "speedup_low": speedup.low, "speedup_high": speedup.high,
            "speedup_best": speedup.best, "comm_ms": 1e3 * cfg.num_layers * s["comm"].median,
            "bound": bound.median / cfg.num_layers,
        })
    if runner.stats.graph < len(batches) * reps:
        raise RuntimeError(f"bench graph: expected every timed step to replay a graph; runner stats "
                           f"{runner.stats.as_dict()}")
    return {"rows": rows, "capture_s": capture_s, "compiles": runner.backend.compiles, "stats": runner.stats.as_dict()}


def _collectives(group, cfg, b, device):
    """One layer's collectives of the demo program (its merge) on tensors of the step's shapes."""
    import torch

    n = group.size
    hl, d = cfg.num_heads // n, cfg.head_dim
    q = torch.randn(b, hl, d, device=device)
    lse = torch.randn(1, b, cfg.num_heads, device=device)
    o = torch.randn(b, cfg.num_heads, d, device=device)
    x = torch.randn(b, cfg.hidden, device=device)

    query, merge = LAYER_MERGES[cfg.merge]

    def run():
        if query == "gather":
            group.all_gather(q, dim=1)
        if merge in ("ag_rs", "fold"):
            group.all_gather(lse, dim=0)
        if merge == "ag_rs":
            group.reduce_scatter(o, dim=1)
        elif merge == "a2a":
            group.all_to_all(torch.cat([o, lse[0, ..., None]], -1), dim=1)
        elif merge == "ag":
            group.all_gather(torch.cat([o, lse[0, ..., None]], -1)[None], dim=0)
        if cfg.merge != "local_ag":  # local_ag: every head on every rank, no TP reduction
            group.all_reduce(x)

    return run


COLUMNS = ["batch", "eager_ms", "graph_ms", "speedup [low-high]", "speedup_best", "comm_ms", "bound"]


def _parser():
    p = harness.parser("cpattn bench graph", __doc__, timeout=True,
                       quick="2 layers, batch 8, 64-token context, 15 rounds (< 60 s)")
    cli.add_parallel(p, dcp=2, block_size=16, interleave=1,
                     helps={"dcp": "DCP ranks: gloo processes, one thread each; the program's TP group too (TP = DCP)"})
    p.add_argument("--layers", type=cli.positive_int, default=4, help="decoder layers of the program")
    p.add_argument("--batches", type=cli.int_list, default="1,8,32", metavar="B,...",
                   help="decode batch sizes to time (each one a capture size), comma-separated")
    p.add_argument("--context", type=cli.positive_int, default=256, help="cached tokens per request")
    p.add_argument("--hidden", type=cli.positive_int, default=256, help="hidden size")
    p.add_argument("--heads", type=cli.positive_int, default=8, help="query heads (a multiple of --dcp)")
    p.add_argument("--kv-heads", type=cli.positive_int, default=2, help="key/value heads (a divisor of --heads)")
    p.add_argument("--head-dim", type=cli.positive_int, default=32, help="head dim (even: rotary embedding)")
    p.add_argument("--merge", default="ag_rs", type=cli_merge, choices=PROGRAM_MERGES,
                   help="DCP layer of the program (cpattn.dcp.layer_merges): ag_rs (4 collectives per layer with "
                        "the TP all-reduce), a2a (3), local_a2a (2: query heads computed locally, one all-to-all), "
                        "local_fold (2: LSE all-gather, the merge folded into the TP all-reduce; old name fold), "
                        "local_ag (1: one all-gather, every head on every rank, no all-reduce)")
    p.add_argument("--reps", type=cli.positive_int, default=30, help="interleaved timing rounds")
    p.add_argument("--backend", default="cpu",
                   help="graph backend for the CPU section (cpu = inductor; see cpattn.graphs.backends())")
    return p


def _validate(p, args) -> None:
    cli.check_backend(p.prog, "--backend", args.backend)
    if args.heads % args.kv_heads:
        cli.bad_value(p.prog, "--kv-heads", f"{args.kv_heads} with --heads {args.heads}",
                      "--heads is a multiple of --kv-heads", f"use --kv-heads in "
                      f"{[d for d in range(1, args.heads + 1) if args.heads % d == 0]}")
    if args.head_dim % 2:
        cli.bad_value(p.prog, "--head-dim", args.head_dim, "an even number (rotary embedding pairs dims)",
                      f"use --head-dim {args.head_dim + 1}")
    n = args.decode_context_parallel_size
    cli.check_engine(p.prog, {"tp_size": "--decode-context-parallel-size/--dcp"}, tp_size=n, dcp_size=n,
                     attention="gqa", num_attention_heads=args.heads, num_kv_heads=args.kv_heads,
                     tp_splits_kv_heads=False, block_size=args.block_size,
                     cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size, capture_sizes=args.batches)


def _shown(rows):
    return [{**r, "speedup [low-high]": f"{r['speedup']:.3g} [{r['speedup_low']:.3g}-{r['speedup_high']:.3g}]"}
            for r in rows]


def main(argv=None) -> int:
    """``cpattn bench graph``: eager vs captured decode steps on DCP gloo ranks (and CUDA when present)."""
    p = _parser()
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.batches, args.context, args.reps = 2, (8,), 64, 15
    _validate(p, args)
    cfg = _config(args)
    import torch
    from cpattn.comm.sim import SimMesh
    from cpattn.graphs import demo_program as dp

    params = dp.init_params(cfg)
    n = args.decode_context_parallel_size
    with harness.Report(args) as out:
        out.payload = {"config": {**vars(args), "program": cfg.__dict__}}
        res = harness.ranks(n, bench_rank, cfg, params, list(args.batches), args.context, args.reps, args.backend,
                            timeout_s=args.timeout, label=f"capturing {len(args.batches)} program(s) per rank with "
                            f"backend {args.backend!r} (compiling takes tens of seconds), then timing {args.reps} "
                            "rounds")
        r0 = res[0]
        out.line(f"CPU, DCP = {n} gloo ranks x 1 thread, {args.layers} layers, context {args.context}, "
                 f"backend {args.backend!r}: capture {r0['capture_s']:.1f} s for {r0['compiles']} programs "
                 f"(run {out.elapsed:.0f} s); medians of {args.reps} interleaved rounds of 5 calls; "
                 "speedup = eager / graph, median [low-high] of per-round ratios; bound = eager / comm")
        out.table(_shown(r0["rows"]), COLUMNS)
        out.payload["cpu"] = res
        if torch.cuda.is_available():  # pragma: no cover - needs a GPU
            group = SimMesh(1).groups()[0]
            cuda = bench_rank(group, cfg, params, list(args.batches), args.context, args.reps, "cuda", device="cuda")
            out.line(f"\nCUDA ({torch.cuda.get_device_name()}), one device, CUDA graphs: capture "
                     f"{cuda['capture_s']:.1f} s")
            out.table(_shown(cuda["rows"]), COLUMNS)
            out.payload["cuda"] = cuda
        else:
            out.line("\nCUDA section skipped: torch.cuda.is_available() is False")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
