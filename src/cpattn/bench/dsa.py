"""DSA benchmark: sparse decode vs dense absorbed-MLA decode, and DSA-CP prefill on gloo ranks.

Part 1 -- one decode query at 32K and 64K context, index_topk k = 2048,
latent 576 (512 + 64 rope), values 512, indexer 64 heads x 128 dims
(DeepSeek-V3.2). Query heads: 128 (DeepSeek-V3.2 without TP) and 16 (what a
rank holds at TP 8). DSA = indexer_scores + topk_indices +
sparse_mla_attention_with_lse; dense = ``attention_with_lse`` with one KV
head of 576 / values 512 over every key; "dense-mm" is the same dense
decode as two plain matmuls (heads as rows), a second baseline. Also the
exact FLOP ratio, the indexer's share of the DSA time, and how often an FP8
(e4m3) indexer changes the selected set on random data.

Part 2 -- DSA-CP prefill of one request on 2 gloo ranks vs 1 rank (1 thread
each), contiguous vs head-tail balanced split: wall time (max over ranks),
the exact per-rank indexer / attention work, and all-gather bytes per rank.

Every ratio is measured side by side in one run (the machine is shared).

    cpattn bench dsa [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from cpattn.comm.launch import spawn
from cpattn.dsa import dsa_cp_attention, dsa_cp_plan, dsa_cp_shard, dsa_cp_work
from cpattn.ops import attention_with_lse
from cpattn.ops.dsa import (
    indexer_scores,
    mla_softmax_scale,
    selection_mismatch,
    sparse_mla_attention_with_lse,
    topk_indices,
)

D_QK, D_V, H_I, D_I = 576, 512, 64, 128
SCALE = mla_softmax_scale(192, 40, 1.0)  # DeepSeek-V3.2: qk_head_dim 192, YaRN factor 40


def best_of(fn, reps: int, budget_s: float = 0.5) -> float:
    """Minimum wall time over at least ``reps`` calls (more while under ``budget_s``), after a warm-up."""
    fn()
    times: list[float] = []
    while len(times) < reps or (sum(times) < budget_s and len(times) < 50):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


# ----------------------------------------------------------------------------- part 1: decode
def decode_case(ctx: int, heads: int, topk: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(ctx + heads)
    s = ctx + 1  # keys including the new token
    q = torch.randn(1, heads, D_QK, generator=g)
    cache = torch.randn(s, D_QK, generator=g)
    q_i, w_i = torch.randn(1, H_I, D_I, generator=g), torch.randn(1, H_I, generator=g)
    k_i = torch.randn(s, D_I, generator=g)
    start, vis = torch.zeros(1, dtype=torch.long), torch.full((1,), s, dtype=torch.long)
    kv, vv = cache[:, None, :], cache[:, None, :D_V].contiguous()
    cu_q, cu_k = torch.tensor([0, 1]), torch.tensor([0, s])

    def indexer():
        return indexer_scores(q_i, w_i, k_i, start, vis, s)

    scores = indexer()
    top = topk_indices(scores, topk)

    def select():
        return topk_indices(scores, topk)

    def sparse():
        return sparse_mla_attention_with_lse(q, cache, top, softmax_scale=SCALE, value_dim=D_V)

    def dsa():
        return sparse_mla_attention_with_lse(q, cache, topk_indices(indexer(), topk), softmax_scale=SCALE,
                                             value_dim=D_V)

    def dense():
        return attention_with_lse(q, kv, vv, cu_q, cu_k, causal=True, softmax_scale=SCALE)

    def dense_mm():
        p = torch.softmax((q[0] @ cache.T) * SCALE, dim=-1)  # [H, S]
        return p @ cache[:, :D_V]

    t = {name: best_of(fn, reps) for name, fn in
         (("indexer", indexer), ("topk", select), ("sparse", sparse), ("dsa", dsa), ("dense", dense),
          ("dense_mm", dense_mm))}
    flops_dense = 2 * heads * s * (D_QK + D_V)
    flops_dsa = 2 * H_I * D_I * s + 2 * heads * topk * (D_QK + D_V)
    return {
        "context": ctx, "heads": heads, "topk": topk, **{f"t_{k}_ms": v * 1e3 for k, v in t.items()},
        "speedup_vs_dense": t["dense"] / t["dsa"], "speedup_vs_dense_mm": t["dense_mm"] / t["dsa"],
        "indexer_share": t["indexer"] / (t["indexer"] + t["topk"] + t["sparse"]),
        "flop_ratio": flops_dense / flops_dsa,
    }


def fp8_case(ctx: int, topk: int, queries: int) -> dict:
    g = torch.Generator().manual_seed(7)
    q_i, w_i = torch.randn(queries, H_I, D_I, generator=g), torch.randn(queries, H_I, generator=g)
    k_i = torch.randn(ctx, D_I, generator=g)
    start = torch.zeros(queries, dtype=torch.long)
    vis = torch.full((queries,), ctx, dtype=torch.long)
    exact = topk_indices(indexer_scores(q_i, w_i, k_i, start, vis, ctx), topk)
    fp8 = topk_indices(indexer_scores(q_i, w_i, k_i, start, vis, ctx, fp8=True), topk)
    return {"context": ctx, "topk": topk, "queries": queries, **selection_mismatch(fp8, exact)}


# ----------------------------------------------------------------------------- part 2: DSA-CP prefill
def cp_inputs(n_tok: int, heads: int, h_i: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n_tok, heads, D_QK, generator=g), torch.randn(n_tok, D_QK, generator=g),
            torch.randn(n_tok, h_i, D_I, generator=g), torch.randn(n_tok, h_i, generator=g),
            torch.randn(n_tok, D_I, generator=g)]


def cp_rank(group, n_tok: int, heads: int, h_i: int, topk: int, split: str, reps: int) -> dict:
    """Time dsa_cp_attention on this rank (best of reps, after a warm-up)."""
    plan = dsa_cp_plan([0, n_tok], group.size, split=split)
    mine = [dsa_cp_shard(x, plan, group.rank) for x in cp_inputs(n_tok, heads, h_i)]
    run = lambda: dsa_cp_attention(*mine, plan, group=group, topk=topk, softmax_scale=SCALE,  # noqa: E731
                                   value_dim=D_V)
    run()
    group.stats.reset()
    times, cpu = [], []
    for _ in range(reps):
        group.all_reduce(torch.zeros(1))  # line the ranks up
        t, c = time.perf_counter(), time.process_time()
        run()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"time": min(times), "cpu": min(cpu), "gather_bytes": group.stats.bytes_sent.get("all_gather", 0) // reps}


def cp_prefill(n_tok: int, heads: int, h_i: int, topk: int, reps: int) -> list[dict]:
    rows = []
    one = spawn(1, cp_rank, n_tok, heads, h_i, topk, "contiguous", reps)
    t1, c1 = one[0]["time"], one[0]["cpu"]
    rows.append({"ranks": 1, "split": "-", "time_s": t1, "speedup": 1.0, "cpu_s": c1, "cpu_speedup": 1.0,
                 "indexer_imbalance": 1.0, "attention_imbalance": 1.0, "gather_MB_per_rank": 0.0})
    for split in ("contiguous", "balanced"):
        res = spawn(2, cp_rank, n_tok, heads, h_i, topk, split, reps)
        work = dsa_cp_work(dsa_cp_plan([0, n_tok], 2, split=split), topk)
        imb = lambda key: max(w[key] for w in work) / (sum(w[key] for w in work) / 2)  # noqa: E731
        t2, c2 = max(r["time"] for r in res), max(r["cpu"] for r in res)
        rows.append({"ranks": 2, "split": split, "time_s": t2, "speedup": t1 / t2, "cpu_s": c2, "cpu_speedup": c1 / c2,
                     "indexer_imbalance": imb("indexer_keys"), "attention_imbalance": imb("attended_keys"),
                     "gather_MB_per_rank": max(r["gather_bytes"] for r in res) / 2**20})
    return rows


# ----------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="cpattn bench dsa", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, finishes in well under a minute")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads for part 1 (1: stable on a shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        contexts, head_counts, reps, topk = [16384], [16, 128], 2, 2048
        prefill = dict(n_tok=1024, heads=16, h_i=16, topk=256, reps=1)
        fp8 = dict(ctx=8192, topk=2048, queries=4)
    else:
        contexts, head_counts, reps, topk = [32768, 65536], [16, 128], 3, 2048
        prefill = dict(n_tok=4096, heads=16, h_i=64, topk=512, reps=2)
        fp8 = dict(ctx=32768, topk=2048, queries=16)

    decode = [decode_case(c, h, topk, reps) for c in contexts for h in head_counts]
    print(f"\nDSA decode, 1 query, k={topk}, Dqk={D_QK}/Dv={D_V}, indexer {H_I}x{D_I}, "
          f"{args.threads} threads (best of {reps})")
    print(f"{'context':>8} {'heads':>5} {'dense ms':>9} {'dense-mm':>9} {'DSA ms':>8} {'indexer':>8} "
          f"{'topk':>6} {'sparse':>7} {'x dense':>8} {'x mm':>6} {'idx share':>9} {'FLOP x':>7}")
    for r in decode:
        print(f"{r['context']:>8} {r['heads']:>5} {r['t_dense_ms']:>9.1f} {r['t_dense_mm_ms']:>9.1f} "
              f"{r['t_dsa_ms']:>8.1f} {r['t_indexer_ms']:>8.1f} {r['t_topk_ms']:>6.1f} {r['t_sparse_ms']:>7.1f} "
              f"{r['speedup_vs_dense']:>8.1f} {r['speedup_vs_dense_mm']:>6.1f} {r['indexer_share']:>9.0%} "
              f"{r['flop_ratio']:>7.1f}")

    fp8_res = fp8_case(**fp8)
    print(f"\nFP8 e4m3 indexer vs fp32 (random data, {fp8['queries']} queries, {fp8['ctx']} keys, k={fp8['topk']}): "
          f"selected set differs in {fp8_res['rows_differ']:.0%} of queries, recall {fp8_res['recall']:.4f}")

    cp = cp_prefill(**prefill)
    print(f"\nDSA-CP prefill, one request of {prefill['n_tok']} tokens, {prefill['heads']} heads, indexer "
          f"{prefill['h_i']}x{D_I}, k={prefill['topk']}, gloo, 1 thread per rank (best of {prefill['reps']})")
    print("(wall: slowest rank; cpu: its process CPU time, the speedup on dedicated cores)")
    print(f"{'ranks':>5} {'split':>10} {'wall s':>7} {'x wall':>7} {'cpu s':>6} {'x cpu':>6} {'indexer max/mean':>16} "
          f"{'attn max/mean':>13} {'gather MB/rank':>14}")
    for r in cp:
        print(f"{r['ranks']:>5} {r['split']:>10} {r['time_s']:>7.2f} {r['speedup']:>7.2f} {r['cpu_s']:>6.2f} "
              f"{r['cpu_speedup']:>6.2f} "
              f"{r['indexer_imbalance']:>16.3f} {r['attention_imbalance']:>13.3f} {r['gather_MB_per_rank']:>14.2f}")

    result = {"decode": decode, "fp8": fp8_res, "dsa_cp_prefill": cp, "quick": args.quick}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
