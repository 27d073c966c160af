"""DSA benchmark: sparse decode vs dense absorbed-MLA decode, and DSA-CP prefill on gloo ranks.

Part 1 -- one decode query at 32K and 64K context, index_topk k = 2048,
latent 576 (512 + 64 rope), values 512, indexer 64 heads x 128 dims
(DeepSeek-V3.2), in ``--dtype`` (default bf16, what models run in). Query
heads: 128 (DeepSeek-V3.2 without TP) and 16 (what a rank holds at TP 8).
DSA = indexer_scores + topk_indices + sparse_mla_attention_with_lse; dense
= ``attention_with_lse`` with one KV head of 576 / values 512 over every
key; "dense-mm" is the same dense decode as two plain fp32 matmuls (heads as
rows), a second baseline. Also: DSA with the FP8 indexer key cache (e4m3,
one scale per key, DeepSeek-V3.2's layout), the exact FLOP ratio and the
measured ratio as a fraction of it, the indexer's share of the DSA time,
and how often bf16 keys / the FP8 cache change the selected set vs fp32
scoring of the same values.

Part 2 -- DSA-CP prefill of one request on TP gloo ranks (DSA-CP reuses
the TP ranks; 1 thread each) vs 1 rank, contiguous vs head-tail balanced
split: wall and CPU time (slowest rank), the exact per-rank indexer /
attention work, and all-gather bytes per rank. Rank 0 also runs the
one-rank baseline, interleaved with both splits.

Every ratio is measured side by side in one run (the machine is shared), in
interleaved rounds (:func:`cpattn.bench.harness.compare`); part 1 reports
best-of times, part 2 the median [low-high] of per-round ratios.

Usage::

    cpattn bench dsa                  # 32K and 64K context; DSA-CP on 2 ranks
    cpattn bench dsa --quick          # small sizes, well under a minute
    cpattn bench dsa --tp 4 --json out.json
"""

from __future__ import annotations

import statistics


from cpattn.bench import harness
from cpattn.bench.harness import Samples, safe_div
from cpattn.config import cli_args as cli

D_QK, D_V, H_I, D_I = 576, 512, 64, 128
TARGET_SPEEDUP, TARGET_OF_FLOP = 9.0, 0.8  # bf16 DSA vs dense at 64K / 128 heads


def softmax_scale() -> float:
    """DeepSeek-V3.2's MLA softmax scale: qk_head_dim 192, YaRN factor 40."""
    from cpattn.ops.dsa import mla_softmax_scale

    return mla_softmax_scale(192, 40, 1.0)



# ----------------------------------------------------------------------------- part 1: decode
def decode_case(ctx: int, heads: int, topk: int, reps: int, dtype: torch.dtype | None = None) -> dict:
    """One decode query at ``ctx`` keys: DSA (bf16 / fp32 indexer keys, and the FP8 key cache) vs dense MLA
    (``dtype`` default: bfloat16)."""
    import torch
    from cpattn.ops import attention_with_lse
    from cpattn.ops.dsa import (
        fp8_index_cache, indexer_scores, selection_mismatch, sparse_mla_attention_with_lse, topk_indices,
    )

    dtype = torch.bfloat16 if dtype is None else dtype
    scale = softmax_scale()

    g = torch.Generator().manual_seed(ctx + heads)
    s = ctx + 1  # keys including the new token
    q = torch.randn(1, heads, D_QK, generator=g).to(dtype)
    cache = torch.randn(s, D_QK, generator=g).to(dtype)
    q_i, w_i = torch.randn(1, H_I, D_I, generator=g).to(dtype), torch.randn(1, H_I, generator=g).to(dtype)
    k_i = torch.randn(s, D_I, generator=g).to(dtype)
    k8, k_scale = fp8_index_cache(k_i)
    start, vis = torch.zeros(1, dtype=torch.long), torch.full((1,), s, dtype=torch.long)
    kv, vv = cache[:, None, :], cache[:, None, :D_V].contiguous()
    cu_q, cu_k = torch.tensor([0, 1]), torch.tensor([0, s])

    def indexer():
        return indexer_scores(q_i, w_i, k_i, start, vis, s)

    def indexer_fp8():
        return indexer_scores(q_i, w_i, k8, start, vis, s, k_scale=k_scale)

    scores = indexer()
    top = topk_indices(scores, topk)

    def select():
        return topk_indices(scores, topk)

    def sparse():
        return sparse_mla_attention_with_lse(q, cache, top, softmax_scale=scale, v_head_dim=D_V)

    def dsa():
        return sparse_mla_attention_with_lse(q, cache, topk_indices(indexer(), topk), softmax_scale=scale,
                                             v_head_dim=D_V)

    def dsa_fp8():
        return sparse_mla_attention_with_lse(q, cache, topk_indices(indexer_fp8(), topk), softmax_scale=scale,
                                             v_head_dim=D_V)

    def dense():
        return attention_with_lse(q, kv, vv, cu_q, cu_k, causal=True, softmax_scale=scale)

    def dense_mm():
        p = torch.softmax((q[0].float() @ cache.float().T) * scale, dim=-1)  # [H, S]
        return p @ cache[:, :D_V].float()

    c = harness.compare({"indexer": indexer, "indexer_fp8": indexer_fp8, "topk": select, "sparse": sparse, "dsa": dsa,
                         "dsa_fp8": dsa_fp8, "dense": dense, "dense_mm": dense_mm}, reps, warmup=1)
    samples = c.samples
    t = {name: s.best for name, s in samples.items()}
    flops_dense = 2 * heads * s * (D_QK + D_V)
    flops_dsa = 2 * H_I * D_I * s + 2 * heads * topk * (D_QK + D_V)
    sp = c.ratio("dense", "dsa")
    # selection exactness of this dtype's keys (and of the FP8 cache) vs fp32 scoring of the same values
    ref = topk_indices(indexer_scores(q_i.float(), w_i.float(), k_i.float(), start, vis, s), topk)
    return {
        "context": ctx, "heads": heads, "topk": topk, "dtype": str(dtype).removeprefix("torch."),
        **{f"t_{k}_ms": v * 1e3 for k, v in t.items()},
        "speedup_vs_dense": sp.median, "speedup_vs_dense_best": sp.best,
        "speedup_vs_dense_mm": safe_div(t["dense_mm"], t["dsa"]),
        "speedup_vs_dense_spread": sp.as_dict(),
        "fp8_speedup_vs_dense_spread": c.ratio("dense", "dsa_fp8").as_dict(),
        "indexer_share": safe_div(t["indexer"], t["indexer"] + t["topk"] + t["sparse"]),
        "flop_ratio": flops_dense / flops_dsa,
        "of_flop_ratio": sp.median / (flops_dense / flops_dsa),
        "selection_vs_fp32": selection_mismatch(top, ref),
        "fp8_selection_vs_fp32": selection_mismatch(topk_indices(indexer_fp8(), topk), ref),
    }


def fp8_case(ctx: int, topk: int, queries: int) -> dict:
    """How often FP8 scoring changes the selected set vs fp32: the simulated FP8 indexer (q and k
    quantized) and the FP8 key cache (k only, DeepSeek-V3.2's cache layout), on random data."""
    import torch
    from cpattn.ops.dsa import fp8_index_cache, indexer_scores, selection_mismatch, topk_indices

    g = torch.Generator().manual_seed(7)
    q_i, w_i = torch.randn(queries, H_I, D_I, generator=g), torch.randn(queries, H_I, generator=g)
    k_i = torch.randn(ctx, D_I, generator=g)
    start = torch.zeros(queries, dtype=torch.long)
    vis = torch.full((queries,), ctx, dtype=torch.long)
    exact = topk_indices(indexer_scores(q_i, w_i, k_i, start, vis, ctx), topk)
    fp8 = topk_indices(indexer_scores(q_i, w_i, k_i, start, vis, ctx, fp8=True), topk)
    k8, k_scale = fp8_index_cache(k_i)
    cache = topk_indices(indexer_scores(q_i, w_i, k8, start, vis, ctx, k_scale=k_scale), topk)
    bf16 = topk_indices(indexer_scores(q_i, w_i, k_i.bfloat16(), start, vis, ctx), topk)
    return {"context": ctx, "topk": topk, "queries": queries, **selection_mismatch(fp8, exact),
            "fp8_cache": selection_mismatch(cache, exact), "bf16_keys": selection_mismatch(bf16, exact)}


# ----------------------------------------------------------------------------- part 2: DSA-CP prefill
def cp_inputs(n_tok: int, heads: int, h_i: int, seed: int = 0) -> list[torch.Tensor]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n_tok, heads, D_QK, generator=g), torch.randn(n_tok, D_QK, generator=g),
            torch.randn(n_tok, h_i, D_I, generator=g), torch.randn(n_tok, h_i, generator=g),
            torch.randn(n_tok, D_I, generator=g)]


def cp_rank(group, n_tok: int, heads: int, h_i: int, topk: int, reps: int) -> dict:
    """Rank function: the one-rank baseline (rank 0), contiguous and balanced DSA-CP, interleaved rounds."""
    from cpattn.comm.sim import SimMesh
    from cpattn.dsa import dsa_cp_attention, dsa_cp_plan
    from cpattn.layout.pcp import pcp_shard

    inputs = cp_inputs(n_tok, heads, h_i)
    solo, scale = SimMesh(1).groups()[0], softmax_scale()

    def runner(split, g, rank):
        plan = dsa_cp_plan([0, n_tok], g.size, split=split)
        mine = [pcp_shard(x, plan, rank) for x in inputs]
        return lambda: dsa_cp_attention(*mine, plan, group=g, topk=topk, softmax_scale=scale, v_head_dim=D_V)

    runs = {"one": runner("contiguous", solo, 0) if group.rank == 0 else (lambda: None)}
    runs.update({split: runner(split, group, group.rank) for split in ("contiguous", "balanced")})
    samples = harness.compare(runs, reps, group=group, warmup=1).samples
    gather = {}
    for split in ("contiguous", "balanced"):
        group.stats.reset()
        runs[split]()
        gather[split] = group.stats.bytes_sent.get("all_gather", 0)
    return {"samples": {k: Samples(s.wall, s.cpu) for k, s in samples.items()}, "gather_bytes": gather}


def cp_prefill(n_tok: int, heads: int, h_i: int, topk: int, reps: int, tp: int = 2,
               timeout_s: float = cli.TIMEOUT_S) -> list[dict]:
    """DSA-CP prefill on ``tp`` gloo ranks vs one rank, both splits: one row per configuration."""
    from cpattn.dsa import dsa_cp_plan, dsa_cp_work

    res = harness.ranks(tp, cp_rank, n_tok, heads, h_i, topk, reps, timeout_s=timeout_s,
                        label=f"DSA-CP prefill of {n_tok} tokens vs one rank")
    s = res[0]["samples"]  # the slowest rank's, sample by sample
    c = harness.Comparison(s)
    one = s["one"]
    rows = [{"ranks": 1, "split": "-", "time_s": one.median, "speedup": 1.0, "speedup_low": 1.0, "speedup_high": 1.0,
             "cpu_s": statistics.median(one.cpu), "cpu_speedup": 1.0, "indexer_imbalance": 1.0,
             "attention_imbalance": 1.0, "gather_MB_per_rank": 0.0}]
    for split in ("contiguous", "balanced"):
        work = dsa_cp_work(dsa_cp_plan([0, n_tok], tp, split=split), topk)
        imb = lambda key: max(w[key] for w in work) / (sum(w[key] for w in work) / tp)  # noqa: E731
        wall, cpu = c.ratio("one", split), c.ratio("one", split, clock="cpu")
        rows.append({"ranks": tp, "split": split, "time_s": s[split].median, "speedup": wall.median,
                     "speedup_low": wall.low, "speedup_high": wall.high, "cpu_s": statistics.median(s[split].cpu),
                     "cpu_speedup": cpu.median, "indexer_imbalance": imb("indexer_keys"),
                     "attention_imbalance": imb("attended_keys"),
                     "gather_MB_per_rank": max(r["gather_bytes"][split] for r in res) / 2**20})
    return rows


# ----------------------------------------------------------------------------- main
def _parser():
    ap = harness.parser("cpattn bench dsa", __doc__, timeout=True,
                        quick="16K context, 1K-token DSA-CP prefill: well under a minute")
    cli.add_parallel(ap, tp=2, helps={"tp": "TP ranks for the DSA-CP prefill (DSA-CP reuses the TP ranks): gloo "
                                            "processes, one thread each"})
    cli.add_dtype(ap, default="bfloat16", help="dtype of the decode part's queries, caches and indexer keys")
    ap.add_argument("--threads", type=cli.positive_int, default=1,
                    help="intra-op threads for part 1 (1: stable on a shared machine)")
    ap.add_argument("--reps", type=cli.positive_int, default=None,
                    help="interleaved timing rounds (default 3; 2 with --quick)")
    return ap


def main(argv=None) -> int:
    """``cpattn bench dsa``: DSA decode vs dense MLA, FP8 selection, DSA-CP prefill; JSON with ``--json``."""
    ap = _parser()
    args = ap.parse_args(argv)
    tp = args.tensor_parallel_size
    if tp < 2:
        cli.bad_value(ap.prog, "--tensor-parallel-size/--tp", tp, "at least 2 (DSA-CP splits tokens over the TP "
                      "ranks and is compared against one rank)", "pass --tp 2 or more")
    cli.check_engine(ap.prog, tp_size=tp, attention="dsa", enable_dsa_cp=True)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        contexts, head_counts, reps, topk = [16384], [16, 128], args.reps or 2, 2048
        prefill = dict(n_tok=1024, heads=16, h_i=16, topk=256, reps=args.reps or 2)
        fp8 = dict(ctx=8192, topk=2048, queries=4)
    else:
        contexts, head_counts, reps, topk = [32768, 65536], [16, 128], args.reps or 3, 2048
        prefill = dict(n_tok=4096, heads=16, h_i=64, topk=512, reps=args.reps or 3)
        fp8 = dict(ctx=32768, topk=2048, queries=16)

    with harness.Report(args) as out:
        out.payload = _run(out, args, tp, contexts, head_counts, reps, topk, prefill, fp8)
    return 0


DECODE_COLUMNS = ["context", "heads", "dense ms", "dense-mm", "DSA ms", "indexer", "idx fp8", "topk", "sparse",
                  "x dense [low-high]", "best", "FLOP x", "of FLOP", "x dense, FP8 keys"]
CP_COLUMNS = ["ranks", "split", "wall s", "x wall", "[low-high]", "cpu s", "x cpu", "indexer max/mean", "attn max/mean",
              "gather MB/rank"]


def _run(out, args, tp, contexts, head_counts, reps, topk, prefill, fp8) -> dict:
    from cpattn.bench.common import DTYPES

    dtype = DTYPES[args.dtype]
    out.progress(f"part 1: DSA decode at {len(contexts) * len(head_counts)} shapes")
    decode = [decode_case(c, h, topk, reps, dtype) for c in contexts for h in head_counts]
    print(f"\nDSA decode, 1 query, {args.dtype}, k={topk}, Dqk={D_QK}/Dv={D_V}, indexer {H_I}x{D_I}, "
          f"{args.threads} threads (times: best of {reps} interleaved rounds; x dense: median [low-high] of the "
          "per-round dense / DSA ratios; of FLOP: x dense / the exact FLOP ratio)")
    shown = []
    for r in decode:
        sp, f8 = r["speedup_vs_dense_spread"], r["fp8_speedup_vs_dense_spread"]
        ms = {col: f"{r[key]:.1f}" for col, key in (
            ("dense ms", "t_dense_ms"), ("dense-mm", "t_dense_mm_ms"), ("DSA ms", "t_dsa_ms"),
            ("indexer", "t_indexer_ms"),
            ("idx fp8", "t_indexer_fp8_ms"), ("topk", "t_topk_ms"), ("sparse", "t_sparse_ms"))}
        shown.append({"context": r["context"], "heads": r["heads"], **ms,
                      "x dense [low-high]": f"{sp['median']:.1f} [{sp['low']:.1f}-{sp['high']:.1f}]",
                      "best": f"{r['speedup_vs_dense_best']:.1f}", "FLOP x": f"{r['flop_ratio']:.1f}",
                      "of FLOP": f"{r['of_flop_ratio']:.2f}",
                      "x dense, FP8 keys": f"{f8['median']:.1f} [{f8['low']:.1f}-{f8['high']:.1f}]"})
    out.table(shown, DECODE_COLUMNS)
    big = [r for r in decode if r["context"] == 65536 and r["heads"] == 128]
    if big:
        r = big[0]
        print(f"target at 64K / 128 heads ({args.dtype}): x dense >= {TARGET_SPEEDUP} and >= {TARGET_OF_FLOP} of the "
              f"FLOP ratio {r['flop_ratio']:.1f}: measured {r['speedup_vs_dense']:.1f}x "
              f"({r['of_flop_ratio']:.2f} of it)")
    for r in decode:
        a8, b16 = r["fp8_selection_vs_fp32"], r["selection_vs_fp32"]
        print(f"selection vs fp32 scoring, {r['context']} keys, {r['heads']} heads: {args.dtype} keys "
              f"{'identical' if b16['rows_differ'] == 0 else 'differs'} (recall {b16['recall']:.4f}); FP8 key cache "
              f"recall {a8['recall']:.4f}")

    out.progress("part 2: FP8 selection")
    fp8_res = fp8_case(**fp8)
    print(f"\nFP8 e4m3 vs fp32 scoring (random data, {fp8['queries']} queries, {fp8['ctx']} keys, k={fp8['topk']}): "
          f"q and k quantized: sets differ in {fp8_res['rows_differ']:.0%} of queries, recall {fp8_res['recall']:.4f}; "
          f"FP8 key cache (per-key scale): differ {fp8_res['fp8_cache']['rows_differ']:.0%}, recall "
          f"{fp8_res['fp8_cache']['recall']:.4f}; bf16 keys: differ {fp8_res['bf16_keys']['rows_differ']:.0%}, "
          f"recall {fp8_res['bf16_keys']['recall']:.4f}")

    cp = cp_prefill(**prefill, tp=tp, timeout_s=args.timeout)
    print(f"\nDSA-CP prefill, one request of {prefill['n_tok']} tokens, {prefill['heads']} heads, indexer "
          f"{prefill['h_i']}x{D_I}, k={prefill['topk']}, gloo, 1 thread per rank (medians of {prefill['reps']} "
          "interleaved rounds)")
    print("(wall: slowest rank; cpu: its process CPU time, the speedup on dedicated cores; x wall [low-high]: "
          "per-round ratios)")
    out.table([{"ranks": r["ranks"], "split": r["split"], "wall s": f"{r['time_s']:.2f}",
                "x wall": f"{r['speedup']:.2f}",
                "[low-high]": f"[{r['speedup_low']:.2f}-{r['speedup_high']:.2f}]", "cpu s": f"{r['cpu_s']:.2f}",
                "x cpu": f"{r['cpu_speedup']:.2f}", "indexer max/mean": f"{r['indexer_imbalance']:.3f}",
                "attn max/mean": f"{r['attention_imbalance']:.3f}", "gather MB/rank": f"{r['gather_MB_per_rank']:.2f}"}
               for r in cp], CP_COLUMNS)
    return {"decode": decode, "fp8": fp8_res, "dsa_cp_prefill": cp, "quick": args.quick, "tp": tp, "dtype": args.dtype}


if __name__ == "__main__":
    raise SystemExit(main())
