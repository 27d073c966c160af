"""Benchmark: graph-captured decode steps vs eager (issue 5, item 5), side by side in one run.

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

Each timing is the median over repetitions (``speedup_min`` compares the
fastest repetitions, which is steadier on a loaded machine); a repetition is
five back-to-back calls framed by two barriers, so it is the slowest
rank's and the barriers are not charged to a single step; eager, graph and
the bound measurements alternate, so drift in machine load hits all alike.
A CUDA section (one device, DCP = 1, CUDA graphs) runs when a GPU is present.

Usage::

    cpattn bench graph            # 4 layers, batch 1/8/32, 256-token context
    cpattn bench graph --quick    # 2 layers, batch 8 (one compile per rank), < 60 s
    cpattn bench graph --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpattn.bench.common import back_to_back, table, write_json
from cpattn.comm.launch import spawn
from cpattn.comm.sim import SimMesh
from cpattn.graphs import DecodeRunner
from cpattn.graphs import demo_program as dp


def _config(args) -> dp.ProgramConfig:
    local = -(-(args.context + 1) // args.dcp)  # tokens per rank per request
    max_blocks = -(-local // args.block_size) + 1
    return dp.ProgramConfig(
        num_layers=args.layers, hidden=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.head_dim, block_size=args.block_size, interleave_size=1, max_blocks=max_blocks,
        num_blocks=max(args.batches) * max_blocks, merge=args.merge,
    )


def bench_rank(group, cfg, params, batches, context, reps, backend, device="cpu"):
    """Rank function: capture, prefill `context` tokens per request, time eager vs graph per batch size."""
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
    once = back_to_back(group, device)
    rows = []
    for b in batches:
        batch = {"x": torch.randn(b, cfg.hidden, generator=gen).to(device),
                 "seq_lens": torch.full((b,), context + 1, device=device), "block_table": block_table[:b].to(device)}
        full = {**batch, "cu_seqlens_q": torch.arange(b + 1, dtype=torch.int32, device=device)}
        eager = lambda: step(state, full)  # noqa: E731
        graph = lambda: runner(batch, [1] * b)  # noqa: E731
        comm = _collectives(group, cfg, b, device)
        for fn in (eager, graph, comm):  # warm-up
            fn()
        te, tg, tc = [], [], []
        for _ in range(reps):  # alternate, so drift in machine load hits all alike
            te.append(once(eager))
            tg.append(once(graph))
            tc.append(once(comm))
        e, g = statistics.median(te), statistics.median(tg)
        c = cfg.num_layers * statistics.median(tc)
        rows.append({
            "batch": b, "eager_ms": 1e3 * e, "graph_ms": 1e3 * g, "speedup": e / g, "speedup_min": min(te) / min(tg),
            "comm_ms": 1e3 * c, "bound": e / max(c, 1e-12),
        })
    assert runner.stats.graph >= len(batches) * reps, runner.stats.as_dict()
    return {"rows": rows, "capture_s": capture_s, "compiles": runner.backend.compiles, "stats": runner.stats.as_dict()}


def _collectives(group, cfg, b, device):
    """One layer's collectives of the demo program (ag_rs merge) on tensors of the step's shapes."""
    n = group.size
    hl, d = cfg.num_heads // n, cfg.head_dim
    q = torch.randn(b, hl, d, device=device)
    lse = torch.randn(1, b, cfg.num_heads, device=device)
    o = torch.randn(b, cfg.num_heads, d, device=device)
    x = torch.randn(b, cfg.hidden, device=device)

    def run():
        group.all_gather(q, dim=1)
        if cfg.merge == "ag_rs":
            group.all_gather(lse, dim=0)
            group.reduce_scatter(o, dim=1)
        else:
            group.all_to_all(torch.cat([o, lse[0, ..., None]], -1), dim=1)
        group.all_reduce(x)

    return run


COLUMNS = ["batch", "eager_ms", "graph_ms", "speedup", "speedup_min", "comm_ms", "bound"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cpattn bench graph", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, batch 8, 64-token context (< 60 s)")
    ap.add_argument("--json", default=None, help="write results as JSON here ('-' for stdout)")
    ap.add_argument("--dcp", type=int, default=2, help="DCP (= TP) ranks, gloo processes")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--merge", default="ag_rs", choices=["ag_rs", "a2a"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--backend", default="cpu", help="graph backend for the CPU section (cpu = inductor)")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.batches, args.context, args.reps = 2, [8], 64, 15
    cfg = _config(args)
    params = dp.init_params(cfg)
    out = {"config": {**vars(args), "program": cfg.__dict__}}

    t0 = time.perf_counter()
    res = spawn(args.dcp, bench_rank, cfg, params, args.batches, args.context, args.reps, args.backend,
                threads=1, timeout_s=900)
    r0 = res[0]
    print(f"CPU, DCP = {args.dcp} gloo ranks x 1 thread, {args.layers} layers, context {args.context}, "
          f"backend {args.backend!r}: capture {r0['capture_s']:.1f} s for {r0['compiles']} programs "
          f"(run {time.perf_counter() - t0:.0f} s)")
    print(table(r0["rows"], COLUMNS))
    out["cpu"] = res

    if torch.cuda.is_available():  # pragma: no cover - needs a GPU
        group = SimMesh(1).groups()[0]
        cuda = bench_rank(group, cfg, params, args.batches, args.context, args.reps, "cuda", device="cuda")
        print(f"\nCUDA ({torch.cuda.get_device_name()}), one device, CUDA graphs: capture {cuda['capture_s']:.1f} s")
        print(table(cuda["rows"], COLUMNS))
        out["cuda"] = cuda
    else:
        print("\nCUDA section skipped: torch.cuda.is_available() is False")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
