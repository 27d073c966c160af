"""Benchmark: DCP decode at long context, one rank vs DCP ranks, side by side in one run.

Decode step at long context, GQA (32 q heads, 8 kv heads, dim 128), batch 4:

- one rank vs DCP = N on N gloo processes with one thread each (attention
  time and whole step, ``ag_rs`` and ``a2a`` merges). Rank 0 also plays the
  single rank (the others wait meanwhile); the one-rank and DCP runs are
  timed in interleaved rounds, each sample started on a barrier and taken
  as the slowest rank's; ratios are the median [low-high] of the per-round
  ratios, in wall time and in process CPU time (robust to a shared machine);
- KV bytes per rank (tokens held, exact) and merge bytes per rank per step
  from ``group.stats`` at every context length (they must not grow with it);
- paged vs contiguous cache attention on one rank;
- the demo's model (tiny Qwen3): one whole decode step, one rank vs DCP,
  for every DCP decode-layer variant (``ag_rs`` 4 collectives per layer,
  ``a2a`` 3, ``local_a2a`` 2, ``local_ag`` 1: "local" computes the group's
  query heads on every rank, the hidden state being replicated), eager and
  graph-captured ("before" = ``ag_rs``, "after" = ``local_ag``), with the
  collectives and bytes of one step counted.

Attention-level steps: ``ag_rs`` / ``a2a`` gather the query heads first
(3 / 2 collectives); ``local a2a`` takes every head locally (1 collective).

Usage::

    cpattn bench dcp                 # 16K and 64K context, DCP = 2
    cpattn bench dcp --quick         # small sizes, < 60 s
    cpattn bench dcp --dcp 4 --dtype fp32 --json out.json
"""

from __future__ import annotations

from cpattn.bench import harness
from cpattn.bench.common import ratio
from cpattn.bench.harness import Samples
from cpattn.config import cli_args as cli
from cpattn.dcp.layer_merges import COLLECTIVES, ENGINE_MERGES

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _build_shard(cfg, ctx, n, rank, gen):
    """Rank `rank` of `n`: paged cache for `batch` requests of `ctx` tokens (random data, shuffled blocks)."""
    import torch
    from cpattn.bench.common import DTYPES
    from cpattn.dcp import dcp_plan
    from cpattn.layout.dcp import dcp_local_lens

    b, hkv, d, bs, inter = cfg["batch"], cfg["hkv"], cfg["d"], cfg["block_size"], cfg["interleave"]
    dtype = DTYPES[cfg["dtype"]]
    local = dcp_local_lens(torch.full((b,), ctx), n, inter)  # [B, N]
    mb = max(-(-int(local.max()) // bs), 1)
    nb = b * mb
    table = torch.randperm(nb, generator=gen).view(b, mb)
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    meta = dcp_plan([ctx] * b, [1] * b, table, dcp_size=n, interleave_size=inter, block_size=bs)
    held = int(local[:, rank].sum())  # tokens this rank really holds
    return {"k": k_cache, "v": v_cache, "table": table, "meta": meta, "held": held,
            "kv_bytes": held * hkv * d * 2 * k_cache.element_size()}


def rank_main(group, cfg):
    """A rank of the DCP group; rank 0 also plays the single rank (the others wait meanwhile)."""
    import torch
    from cpattn.bench.common import DTYPES
    from cpattn.comm.sim import SimMesh
    from cpattn.dcp import dcp_decode
    from cpattn.ops.paged import paged_attention_with_lse

    n, r = group.size, group.rank
    solo = SimMesh(1).groups()[0]  # a group of one: the single-rank baseline
    gen = torch.Generator().manual_seed(1234 + r)
    b, hq, d = cfg["batch"], cfg["hq"], cfg["d"]
    dtype = DTYPES[cfg["dtype"]]
    out = {}
    for ctx in cfg["contexts"]:
        mine = _build_shard(cfg, ctx, n, r, gen)
        full = _build_shard(cfg, ctx, 1, 0, gen) if r == 0 else None
        q = torch.randn(b, hq // n, d, generator=gen).to(dtype)  # this rank's TP heads
        q_all = torch.randn(b, hq, d, generator=gen).to(dtype)  # all heads (what the gather delivers)

        def attn(sh, who):
            m = sh["meta"]
            return paged_attention_with_lse(q_all, sh["k"], sh["v"], sh["table"], m.req_indices, m.kv_lens[who])

        def step(sh, g, merge, qq, query="gather"):
            return dcp_decode(qq, (sh["k"], sh["v"]), sh["meta"], group=g, merge=merge, query=query)

        noop = lambda: None  # noqa: E731
        runs = {
            "attn_one": (lambda: attn(full, 0)) if r == 0 else noop,
            "attn_dcp": lambda: attn(mine, r),
            "step_ag_rs_one": (lambda: step(full, solo, "ag_rs", q_all)) if r == 0 else noop,
            "step_ag_rs_dcp": lambda: step(mine, group, "ag_rs", q),
            "step_a2a_one": (lambda: step(full, solo, "a2a", q_all)) if r == 0 else noop,
            "step_a2a_dcp": lambda: step(mine, group, "a2a", q),
            "step_local_a2a_one": (lambda: step(full, solo, "a2a", q_all, "local")) if r == 0 else noop,
            "step_local_a2a_dcp": lambda: step(mine, group, "a2a", q_all, "local"),
        }
        samples = harness.compare(runs, cfg["reps"], group=group, warmup=1).samples
        rec = {"samples": {k: Samples(s.wall, s.cpu) for k, s in samples.items()},
               "kv_bytes": mine["kv_bytes"], "kv_tokens": mine["held"],
               "kv_bytes_allocated": mine["k"].nbytes + mine["v"].nbytes}
        if full is not None:
            rec.update(kv_bytes_one=full["kv_bytes"])
        for merge in ("ag_rs", "a2a", "local_a2a"):
            group.stats.reset()
            if merge == "local_a2a":
                step(mine, group, "a2a", q_all, "local")
            else:
                step(mine, group, merge, q)
            rec[f"bytes_{merge}"] = group.stats.as_dict()
        group.all_reduce(torch.zeros(1))
        if r == 0 and cfg["paged_vs_contiguous"]:
            rec.update(_paged_vs_contiguous(full, q_all, cfg))
        group.all_reduce(torch.zeros(1))
        out[ctx] = rec
        del mine, full
    return out


# ----------------------------------------------------------------------------- the demo model's decode step
STEP_VARIANTS = tuple(sorted(ENGINE_MERGES, key=COLLECTIVES.get, reverse=True))  # DCPStep.merge: 4, 3, 2, 1 coll.


def _model_shard(fam, cfg, ctx, n, gen):
    """A paged shard for one request of ``ctx`` cached tokens, random data (as prefilled), interleave = block 16."""
    import torch
    from cpattn.engine.paged_cache import PagedShard

    sh = PagedShard.empty(fam.kv_layouts(cfg), capacity=[ctx + 8], dcp_size=n, block_size=16, interleave_size=16)
    for t in (*sh.k, *sh.v):
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=gen))
    return sh


def model_step_rank(group, cfg):
    """The demo's embedded tiny Qwen3: one whole decode step (embedding, layers with DCP attention, lm_head),
    one rank vs DCP ranks, for every DCPStep variant (eager; graph-captured for "ag_rs" and "local_ag")."""
    import torch
    from cpattn.comm.sim import SimMesh
    from cpattn.bench.demo_run import EMBEDDED_STD
    from cpattn.engine.decode import decode_step, make_runner
    from cpattn.models.family import get_family

    fam = get_family("qwen3")
    mcfg = fam.config_class.tiny()  # the demo's embedded model
    params = fam.init_params(mcfg, seed=0, std=EMBEDDED_STD)
    ctx, n, r = cfg["model_context"], group.size, group.rank
    gen = torch.Generator().manual_seed(99 + r)
    solo = SimMesh(1).groups()[0]

    def batch_of(sh):
        return {"tokens": torch.tensor([7]), "seq_lens": torch.tensor([ctx + 1]), "block_table": sh.block_table}

    def eager(sh, g, merge):
        b = {**batch_of(sh), "cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32)}
        return lambda: decode_step({"params": params, "shard": sh}, b, family=fam, cfg=mcfg, group=g, merge=merge)[1]

    noop = lambda: None  # noqa: E731
    full = _model_shard(fam, mcfg, ctx, 1, gen) if r == 0 else None
    runs = {"one": eager(full, solo, "ag_rs") if r == 0 else noop}
    shards = {}
    for v in STEP_VARIANTS:
        shards[v] = _model_shard(fam, mcfg, ctx, n, gen)
        runs[v] = eager(shards[v], group, v)
    counts = {}
    for v in STEP_VARIANTS:  # collectives and bytes of one step, counted
        group.stats.reset()
        runs[v]()
        counts[v] = {"calls": sum(group.stats.calls.values()), "bytes": group.stats.total_sent(),
                     "kinds": dict(group.stats.calls)}
    if cfg["model_graph"]:
        for v in ("ag_rs", "local_ag"):
            sh = _model_shard(fam, mcfg, ctx, n, gen)
            runner = make_runner(group, fam, params, mcfg, sh, num_speculative_tokens=0, max_requests=1, merge=v,
                                 capture_sizes=[1], backend="cpu")
            runs[f"graph_{v}"] = (lambda rn=runner, s=sh: rn(batch_of(s), [1]))
    samples = harness.compare(runs, cfg["reps"], group=group, inner=5, warmup=2).samples
    return {"samples": {k: Samples(s.wall, s.cpu) for k, s in samples.items()}, "counts": counts,
            "layers": mcfg.num_hidden_layers}


def _model_report(cfg, res, n) -> list[dict]:
    s, counts, layers = res["samples"], res["counts"], res["layers"]
    print(f"\nWhole decode step of the demo's model (tiny Qwen3, {layers} layers, batch 1, context "
          f"{cfg['model_context']}): one rank (eager) vs DCP = {n} on gloo, every DCP decode-layer variant, "
          f"{cfg['reps']} interleaved rounds of 5 steps (slowest rank). x one = step / one rank's; x ag_rs = step / "
          "the ag_rs step's (before -> after): median [low-high] of per-round ratios")
    print(f"{'variant':<16} {'collectives/layer':>17} {'bytes/step/rank':>15} {'step ms':>8} {'x one':>18} "
          f"{'x ag_rs':>18}")
    rows = []
    one_ms = 1e3 * s["one"].median
    print(f"{'one rank':<16} {0:>17} {0:>15} {one_ms:>8.2f} {'1':>18} {'':>18}")
    for name in (*STEP_VARIANTS, "graph_ag_rs", "graph_local_ag"):
        if name not in s:
            continue
        v = name.removeprefix("graph_")
        base = s["graph_ag_rs" if name.startswith("graph_") else "ag_rs"]
        c = counts[v]
        x1, xb = ratio(s[name], s["one"]), ratio(s[name], base)
        label = f"{v} (graph)" if name.startswith("graph_") else v
        print(f"{label:<16} {c['calls'] / layers:>17.0f} {c['bytes']:>15,} {1e3 * s[name].median:>8.2f} "
              f"{str(x1):>18} {str(xb):>18}")
        rows.append({"metric": "model_step", "variant": label, "collectives_per_layer": c["calls"] / layers,
                     "bytes_per_step": c["bytes"], "kinds": c["kinds"], "step_ms": 1e3 * s[name].median,
                     "vs_one_rank": x1.as_dict(), "vs_ag_rs": xb.as_dict()})
    return rows


def _folded_contiguous(q, k, v, scale):
    """The paged kernel's math on contiguous K/V: q [Hq, D], k/v [L, Hkv, D], GQA heads folded into rows."""
    import torch

    hq, d = q.shape
    hkv = k.shape[1]
    qf = q.view(hkv, hq // hkv, d)[None]  # [1, Hkv, G, D]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qf, k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, False, scale=scale)


def _paged_vs_contiguous(sh, q_all, cfg):
    """One rank: the same attention on contiguous copies of the paged cache, interleaved (CPU time)."""
    import torch
    from cpattn.ops import attention_with_lse
    from cpattn.ops.paged import paged_attention_with_lse

    k_cache, v_cache, table, meta = sh["k"], sh["v"], sh["table"], sh["meta"]
    b, kv_lens = table.shape[0], meta.kv_lens[0]
    ctx = int(kv_lens.max())
    # gather each request's blocks into one contiguous [L, Hkv, D] (outside the timing)
    ks = [k_cache[table[i]].flatten(0, 1)[:ctx] for i in range(b)]
    vs = [v_cache[table[i]].flatten(0, 1)[:ctx] for i in range(b)]
    k_flat, v_flat = torch.cat(ks), torch.cat(vs)  # [B*L, Hkv, D]
    cu_q = torch.arange(b + 1, dtype=torch.int32)
    cu_k = cu_q * ctx
    scale = cfg["d"] ** -0.5
    fns = {
        "paged": lambda: paged_attention_with_lse(q_all, k_cache, v_cache, table, meta.req_indices, kv_lens,
                                                  softmax_scale=scale),
        "contig_varlen": lambda: attention_with_lse(q_all, k_flat, v_flat, cu_q, cu_k, causal=False,
                                                    softmax_scale=scale),
        "contig_folded": lambda: [_folded_contiguous(q_all[i], ks[i], vs[i], scale) for i in range(b)],
    }
    c = harness.compare(fns, cfg["reps"], warmup=1)
    s = c.samples
    got, want = s["paged"].result[0], s["contig_varlen"].result[0]
    return {"contiguous_over_paged": {k: c.ratio(k, "paged", clock="cpu").as_dict()
                                      for k in ("contig_folded", "contig_varlen")},
            "paged_cpu_s": min(s["paged"].cpu),
            "paged_vs_contig_maxdiff": (got.float() - want.float()).abs().max().item()}


def _bytes(rec, merge, cfg, n):
    """(merge bytes, query-gather bytes) one rank sends per step, from group.stats ("local_*": no gather)."""
    from cpattn.bench.common import DTYPES

    total = sum(rec[f"bytes_{merge}"]["bytes_sent"].values())
    q_gather = 0 if merge.startswith("local") else cfg["batch"] * cfg["hq"] // n * cfg["d"] * DTYPES[cfg["dtype"]].itemsize * (n - 1)
    return total - q_gather, q_gather


def _parser():
    p = harness.parser("cpattn bench dcp", __doc__, timeout=True,
                       quick="batch 2, contexts 2K and 8K, 3 rounds (< 60 s)")
    cli.add_parallel(p, dcp=2, block_size=128, interleave=128,
                     helps={"dcp": "DCP ranks: gloo processes, one thread each (DCP reuses the TP ranks: TP = DCP)"})
    p.add_argument("--contexts", type=cli.int_list, default="16384,65536", metavar="N,...",
                   help="cached tokens per request, comma-separated")
    p.add_argument("--batch", type=cli.positive_int, default=4, help="decode requests")
    cli.add_dtype(p, default="bfloat16", help="KV cache and query dtype")
    p.add_argument("--reps", type=cli.positive_int, default=5, help="interleaved timing rounds")
    p.add_argument("--model-context", type=cli.nonnegative_int, default=4096,
                   help="cached tokens of the demo-model decode step (the demo's prompt length; 0: skip that part)")
    p.add_argument("--no-model-graph", action="store_true",
                   help="skip the graph-captured demo-model steps (two inductor compiles per rank)")
    return p


def main(argv=None):
    """Run the DCP benchmark and print a table of side-by-side ratios."""
    p = _parser()
    args = p.parse_args(argv)
    n = args.decode_context_parallel_size
    if args.quick:
        args.batch, args.contexts, args.reps = 2, (2048, 8192), min(args.reps, 3)
        args.model_context, args.no_model_graph = 1024, True
    if n < 2:
        cli.bad_value(p.prog, "--decode-context-parallel-size/--dcp", n, "at least 2 (this benchmark compares "
                      "DCP against one rank)", "pass --dcp 2 or more")
    cli.check_engine(p.prog, {"tp_size": "--decode-context-parallel-size/--dcp"}, tp_size=n, dcp_size=n,
                     attention="gqa", num_attention_heads=HEADS, num_kv_heads=KV_HEADS, tp_splits_kv_heads=False,
                     block_size=args.block_size, cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size)
    cfg = dict(batch=args.batch, hq=HEADS, hkv=KV_HEADS, d=HEAD_DIM, block_size=args.block_size,
               interleave=args.cp_kv_cache_interleave_size, dtype=args.dtype, contexts=list(args.contexts),
               reps=args.reps, paged_vs_contiguous=True, model_context=args.model_context,
               model_graph=not args.no_model_graph)
    with harness.Report(args) as out:
        ranks = harness.ranks(n, rank_main, cfg, timeout_s=args.timeout, label="decode steps, one rank vs DCP")
        rows = _report(cfg, ranks, n)
        if cfg["model_context"]:
            model = harness.ranks(n, model_step_rank, cfg, timeout_s=max(args.timeout, 900.0),
                                  label="the demo model's decode step, every DCP variant")[0]
            rows += _model_report(cfg, model, n)
        out.line(f"({out.elapsed:.0f} s)")
        out.payload = {"config": cfg, "dcp": n, "rows": rows}
    return 0


def _report(cfg, ranks, n) -> list[dict]:
    from cpattn.bench.common import DTYPES

    print(f"DCP decode step: batch {cfg['batch']}, GQA {cfg['hq']} q / {cfg['hkv']} kv heads x {cfg['d']}, "
          f"{cfg['dtype']}, block {cfg['block_size']}, interleave {cfg['interleave']}; gloo, {n} ranks x 1 thread. "
          f"Medians of {cfg['reps']} interleaved rounds (slowest rank); DCP/1 = median [low-high] of per-round "
          "ratios; CPU ms = process CPU time, robust to a shared machine")
    hdr = f"{'context':>8} | {'metric':<30} | {'1 rank':>10} | {f'DCP={n}':>10} | DCP/1 [low-high]"
    print(hdr)
    print("-" * (len(hdr) + 8))
    rows = []
    for ctx in cfg["contexts"]:
        a = ranks[0][ctx]
        s = a["samples"]  # already the slowest rank's, sample by sample
        for key, name in (("attn", "attention"), ("step_ag_rs", "step, ag_rs (3 coll.)"),
                          ("step_a2a", "step, a2a (2 coll.)"), ("step_local_a2a", "step, local a2a (1 coll.)")):
            for clock, what in (("wall", "wall ms"), ("cpu", "CPU ms")):
                one, dcp = s[f"{key}_one"], s[f"{key}_dcp"]
                r = ratio(dcp, one, clock=clock)
                med = lambda x: sorted(x.of(clock))[len(x.of(clock)) // 2] * 1e3  # noqa: E731
                print(f"{ctx:>8} | {name + ' (' + what + ')':<30} | {med(one):>10.2f} | {med(dcp):>10.2f} | {r}")
                rows.append({"context": ctx, "metric": f"{key}_{clock}_ms", "one_rank": med(one), "dcp": med(dcp),
                             "ratio": r.as_dict()})
        unit = cfg["interleave"] * cfg["hkv"] * cfg["d"] * 2 * DTYPES[cfg["dtype"]].itemsize
        both = [x[ctx] for x in ranks]
        worst = max(abs(x["kv_bytes"] - a["kv_bytes_one"] / n) for x in both) / unit
        held = max(x["kv_bytes"] for x in both)
        print(f"{ctx:>8} | {'KV bytes held/rank (MiB)':<30} | {a['kv_bytes_one'] / 2**20:>10.2f} | "
              f"{held / 2**20:>10.2f} | {held / a['kv_bytes_one']:.3f} (off 1/{n} by {worst:.2f} interleave units)")
        rows.append({"context": ctx, "metric": "kv_bytes_per_rank", "one_rank": a["kv_bytes_one"], "dcp": held})
        for m in ("ag_rs", "a2a", "local_a2a"):
            merge_b, q_b = _bytes(a, m, cfg, n)
            kinds = ", ".join(f"{k} {v}" for k, v in a[f"bytes_{m}"]["bytes_sent"].items())
            print(f"{ctx:>8} | {'bytes sent/rank, ' + m:<30} | merge {merge_b} + query gather {q_b}  ({kinds})")
            rows.append({"context": ctx, "metric": f"bytes_sent_{m}", "merge": merge_b, "query_gather": q_b})
        if "contiguous_over_paged" in a:
            c = a["contiguous_over_paged"]
            fmt = lambda d: f"{d['median']:.2f}x [{d['low']:.2f}-{d['high']:.2f}]"  # noqa: E731
            print(f"{ctx:>8} | {'paged vs contiguous, 1 rank':<30} | contiguous / paged CPU time: aten flash, GQA "
                  f"folded {fmt(c['contig_folded'])}; attention_with_lse {fmt(c['contig_varlen'])}  (paged "
                  f"{a['paged_cpu_s'] * 1e3:.1f} ms, max diff {a['paged_vs_contig_maxdiff']:.1e})")
            rows.append({"context": ctx, "metric": "contiguous_over_paged", **c})
    c0, c1 = cfg["contexts"][0], cfg["contexts"][-1]
    for m in ("ag_rs", "a2a", "local_a2a"):
        b0, b1 = _bytes(ranks[0][c0], m, cfg, n)[0], _bytes(ranks[0][c1], m, cfg, n)[0]
        print(f"merge bytes/rank ({m}): {b0} at {c0} tokens, {b1} at {c1} -> "
              f"{'independent of' if b0 == b1 else 'CHANGES with'} context length")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
