"""DeepSeek-V4 benchmark: KV bytes per token, decode one rank vs DCP, prefill one rank vs PCP.

Part 1 -- KV bytes per token of context (exact counts, no timing): what one
request keeps between decode steps in DeepSeek-V4 (window ring, CSA / HCA
entries, CSA indexer keys, compressor state), DeepSeek-V3.2 (latent row and
indexer key per token per layer) and dense MLA (DeepSeek-V3), at 64K and 1M
tokens, bf16 (:mod:`cpattn.bench.v4_kv_bytes`). Every size is a transformers 5.24
config default -- ``DeepseekV4Config()``, ``DeepseekV32Config()``,
``DeepseekV3Config()`` -- and is re-read from the installed transformers
when it is there. Also the bytes per DCP rank at DCP = 2 (V4's entries
shard, its rings are replicated; MLA's rows shard).

Part 2 -- one decode step of one V4 attention layer (CSA and HCA) at 64K
context, real per-layer sizes (64 heads of 512, window 128, m = 4 / 128,
top-512 by a 64 x 128 indexer), 4 requests: one rank vs DCP = 2 on two gloo
processes with one thread each (rank 0 also runs the one-rank step; the
samples of both are taken in interleaved rounds, each the slowest rank's),
in bf16 (as models run) and fp32. The step is the engine's planned decode
step (:class:`~cpattn.v4.decode.V4DecodeStep`: window with sinks for this
rank's heads, compressor pooling, indexer top-k over key-sharded entries
with the candidate exchange, sparse entry attention, one all-gather merge).
Of that, only the indexer's scoring grows with the context (and halves under
DCP); the window, pooling, the sparse attention over 512 entries and the
merge are fixed per step, so the ratio nears 2 only at long contexts --
DCP's sure gain is the KV bytes per rank (part 1 and the table's KV MB/rank).

Part 3 -- prefill of one V4 attention layer (sliding, CSA, HCA) over 16K
tokens, one rank vs PCP = 2 (:func:`~cpattn.v4.pcp.v4_pcp_attention`:
window halos, entries pooled where their window ends, one entry all-gather),
in ``--dtype`` (default fp32: this CPU has no bf16 matmul units, so bf16
times mostly measure conversions). To fit a CPU in a minute: the heads a TP
8 rank holds (8 of 64; the indexer likewise 8 of 64) and a CSA top-64
(the CPU sparse kernel gathers T x k x 512 entry values). The bytes each
rank sends are exact and printed too.

Ratios are one rank / CP ranks: the median [low-high] of per-round ratios
and the best-vs-best; never divided by a time that can be 0.

Usage::

    cpattn bench v4                  # 64K decode, 16K prefill: a couple of minutes
    cpattn bench v4 --quick          # 4K decode, 512-token prefill: seconds
    cpattn bench v4 --json -         # JSON only on stdout
"""

from __future__ import annotations

from dataclasses import replace


from cpattn.bench import harness
from cpattn.bench.harness import Samples, Spread
from cpattn.config import cli_args as cli

# per-layer sizes of DeepseekV4Config() (transformers 5.24 defaults)
HEADS, D, WINDOW, CSA_M, HCA_M, TOPK, H_I, D_I = 64, 512, 128, 4, 128, 512, 64, 128
BLOCK = 64
PREFILL_TOPK = 64  # the prefill part's CSA top-k: its CPU kernel gathers T x k x D entry values


# ----------------------------------------------------------------------------- part 1: KV bytes
def sources() -> dict[str, str]:
    """Where every size comes from (and whether the installed transformers agrees)."""
    from cpattn.bench.v4_kv_bytes import V3, V32, V4

    out = {
        "v4": f"DeepseekV4Config() defaults: {len(V4.layer_kinds)} layers ({V4.layer_kinds.count('csa')} CSA m="
              f"{V4.csa_ratio}, {V4.layer_kinds.count('hca')} HCA m={V4.hca_ratio}), head_dim {V4.head_dim}, "
              f"sliding_window {V4.window}, index_head_dim {V4.index_head_dim}",
        "v32": f"DeepseekV32Config() defaults: {V32.num_layers} layers x (kv_lora_rank {V32.kv_lora_rank} + "
               f"qk_rope_head_dim {V32.qk_rope_head_dim} + index_head_dim {V32.index_head_dim})",
        "mla": f"DeepseekV3Config() defaults: {V3.num_layers} layers x (kv_lora_rank {V3.kv_lora_rank} + "
               f"qk_rope_head_dim {V3.qk_rope_head_dim})",
    }
    try:
        import transformers
    except ImportError:
        out["checked"] = "transformers not installed: sizes as recorded in cpattn.bench.v4_kv_bytes (from 5.24)"
        return out
    c4, c32, c3 = transformers.DeepseekV4Config(), transformers.DeepseekV32Config(), transformers.DeepseekV3Config()
    kinds = {"compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca",
             "sliding_attention": "sliding"}
    same = (tuple(kinds[t] for t in c4.layer_types) == V4.layer_kinds and c4.head_dim == V4.head_dim
            and c4.sliding_window == V4.window and c4.index_head_dim == V4.index_head_dim
            and (c32.num_hidden_layers, c32.kv_lora_rank, c32.qk_rope_head_dim, c32.index_head_dim)
            == (V32.num_layers, V32.kv_lora_rank, V32.qk_rope_head_dim, V32.index_head_dim)
            and (c3.num_hidden_layers, c3.kv_lora_rank, c3.qk_rope_head_dim)
            == (V3.num_layers, V3.kv_lora_rank, V3.qk_rope_head_dim))
    out["checked"] = (f"re-read from the installed transformers {transformers.__version__}: "
                      f"{'identical' if same else 'DIFFERENT (the table uses the recorded 5.24 sizes)'}")
    return out


def kv_rows(contexts, dcp: int = 2) -> list[dict]:
    """Exact bytes per request (bf16) and per token, plus per DCP rank at ``dcp`` ranks."""
    from cpattn.bench.v4_kv_bytes import kv_bytes_table, v4_kv_elements

    rows = []
    for row in kv_bytes_table(contexts):
        n = row["context"]
        parts = v4_kv_elements(n)
        shard = parts["csa_entries"] + parts["csa_index_keys"] + parts["hca_entries"]  # interleaved over ranks
        per_rank_v4 = 2 * (-(-shard // dcp) + parts["window"] + parts["compressor_state"])
        rows.append({**row, "v4_parts_bytes": {k: 2 * v for k, v in parts.items()},
                     f"v4_per_rank_dcp{dcp}": per_rank_v4, f"v32_per_rank_dcp{dcp}": -(-row["v32"] // dcp),
                     f"mla_per_rank_dcp{dcp}": -(-row["mla"] // dcp)})
    return rows


# ----------------------------------------------------------------------------- layer inputs
def layer_input(kind: str, t: int, heads: int, h_i: int, dtype: torch.dtype, gen: torch.Generator,
                topk: int = TOPK) -> LayerInput:
    """Random inputs of one V4 attention layer for ``t`` tokens (the entries' "finish" is the identity)."""
    import torch
    from cpattn.v4.attention import Compression, LayerInput

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    def finish(pooled, positions):
        return pooled

    comp = idx = None
    if kind != "sliding":
        m, c = (CSA_M, 2 * D) if kind == "csa" else (HCA_M, D)
        comp = Compression(r(t, c), r(t, c), torch.randn(m, c, generator=gen), finish)
    if kind == "csa":
        idx = Compression(r(t, 2 * D_I), r(t, 2 * D_I), torch.randn(CSA_M, 2 * D_I, generator=gen), finish)
    return LayerInput(r(t, heads, D), r(t, D), torch.randn(heads, generator=gen), D**-0.5, comp,
                      r(t, h_i, D_I) if kind == "csa" else None,
                      torch.rand(t, h_i, generator=gen) if kind == "csa" else None, idx, topk)


def _layout(kind: str) -> V4Layout:
    from cpattn.v4.cache import V4Layout

    return V4Layout(kinds=(kind,), head_dim=D, window=WINDOW, csa_ratio=CSA_M, hca_ratio=HCA_M, index_head_dim=D_I,
                    block_size=BLOCK)


def filled_cache(kind: str, ctx: int, dtype: torch.dtype, rank: int, size: int, gen: torch.Generator,
                 batch: int = 1) -> V4Cache:
    """This DCP rank's cache of ``batch`` requests after ``ctx`` tokens each, random rows everywhere (as if
    prefilled)."""
    import torch
    from cpattn.v4.cache import V4Cache

    cache = V4Cache.empty(_layout(kind), batch=batch, max_len=ctx + 8, dtype=dtype, dcp_rank=rank, dcp_size=size)
    for ts in (cache.window, cache.raw, cache.index_raw, cache.entries, cache.index_keys):
        for t in ts:
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=gen))
    return replace(cache, seq_lens=(ctx,) * batch, high_water=(ctx,) * batch)


# ----------------------------------------------------------------------------- part 2: decode, one rank vs DCP
def decode_rank(group, cfg: dict) -> dict:
    """Rank function: one decode step of each (kind, dtype), one rank (rank 0) vs DCP over ``group``."""
    import torch
    from cpattn.bench.common import DTYPES
    from cpattn.comm.sim import SimMesh
    from cpattn.v4.decode import cache_state, decode_plan, V4DecodeStep

    solo, r = SimMesh(1).groups()[0], group.rank
    gen = torch.Generator().manual_seed(11 + r)
    runs, held = {}, {}
    for dtype_name in cfg["dtypes"]:
        dtype = DTYPES[dtype_name]
        for kind in ("csa", "hca"):
            b = cfg["batch"]
            inp = layer_input(kind, b, HEADS, H_I, dtype, torch.Generator().manual_seed(5))  # same on every rank

            def step(g, rank, size, kind=kind, dtype=dtype, inp=inp):
                cache = filled_cache(kind, cfg["context"], dtype, rank, size, gen, b)
                plan = decode_plan(cache, list(range(b)), [cfg["context"]] * b, 1)
                st = V4DecodeStep(cache.layout, cache_state(cache), plan, g)
                return (lambda: st.attend(0, inp)), cache.kv_bytes()

            key = f"{kind}_{dtype_name}"
            runs[f"{key}_dcp"], held[key] = step(group, r, group.size)
            runs[f"{key}_one"] = step(solo, 0, 1)[0] if r == 0 else (lambda: None)
    samples = harness.compare(runs, cfg["reps"], group=group, warmup=1).samples
    group.stats.reset()
    for name, fn in runs.items():
        if name.endswith("_dcp"):
            before = group.stats.total_sent()
            fn()
            held[name[:-4] + "_sent"] = group.stats.total_sent() - before
    return {"samples": {k: Samples(s.wall, s.cpu) for k, s in samples.items()}, "facts": held}


def decode_rows(res: list[dict], ctx: int, dcp: int, dtypes: list[str], batch: int = 1) -> list[dict]:
    """Table rows of part 2 from every rank's :func:`decode_rank` result."""
    s = res[0]["samples"]  # the slowest rank's, sample by sample
    rows = []
    for dtype_name in dtypes:
        for kind in ("csa", "hca"):
            key = f"{kind}_{dtype_name}"
            one, cp = s[f"{key}_one"], s[f"{key}_dcp"]
            c = harness.Comparison({"one": one, "cp": cp})
            wall, cpu = c.ratio("one", "cp"), c.ratio("one", "cp", clock="cpu")
            rows.append({"kind": kind, "dtype": dtype_name, "context": ctx, "batch": batch, "dcp": dcp,
                         "one_ms": 1e3 * one.median,
                         "dcp_ms": 1e3 * cp.median, "speedup": wall.as_dict(), "cpu_speedup": cpu.as_dict(),
                         "kv_bytes_per_rank": max(x["facts"][key] for x in res),
                         "bytes_sent_per_rank": max(x["facts"][key + "_sent"] for x in res)})
    return rows


# ----------------------------------------------------------------------------- part 3: prefill, one rank vs PCP
def prefill_rank(group, cfg: dict) -> dict:
    """Rank function: one layer's prefill of each kind, one rank (rank 0) vs PCP over ``group``."""
    import torch
    from cpattn.bench.common import DTYPES
    from cpattn.comm.sim import SimMesh
    from cpattn.v4.pcp import v4_pcp_attention, v4_pcp_plan

    solo, r, n = SimMesh(1).groups()[0], group.rank, cfg["tokens"]
    dtype = DTYPES[cfg["dtype"]]
    runs, sent = {}, {}
    for kind in ("sliding", "csa", "hca"):
        inp = layer_input(kind, n, cfg["heads"], cfg["index_heads"], dtype, torch.Generator().manual_seed(3),
                          cfg["topk"])
        lay = _layout(kind)

        def run(g, rank, kind=kind, inp=inp, lay=lay):
            plan = v4_pcp_plan([0, n], g.size, lay)
            mine = _shard(inp, plan.pcp.token_index[rank], plan.pcp, rank)
            return lambda: v4_pcp_attention(mine, kind, plan, g).out

        runs[f"{kind}_pcp"] = run(group, r)
        runs[f"{kind}_one"] = run(solo, 0) if r == 0 else (lambda: None)
    samples = harness.compare(runs, cfg["reps"], group=group, warmup=1).samples
    for kind in ("sliding", "csa", "hca"):
        group.stats.reset()
        runs[f"{kind}_pcp"]()
        sent[kind] = group.stats.as_dict()["bytes_sent"]
    return {"samples": {k: Samples(s.wall, s.cpu) for k, s in samples.items()}, "sent": sent}


def _shard(inp: LayerInput, idx: torch.Tensor, plan, rank: int) -> LayerInput:
    from cpattn.layout.pcp import pcp_shard
    from cpattn.v4.attention import Compression, LayerInput

    def pick(x):
        return None if x is None else pcp_shard(x, plan, rank)

    def comp(c):
        return None if c is None else Compression(pick(c.kv), pick(c.gate), c.position_bias, c.finish)

    return LayerInput(pick(inp.q), pick(inp.kv), inp.sinks, inp.scale, comp(inp.compression), pick(inp.index_q),
                      pick(inp.index_weights), comp(inp.index_compression), inp.topk)


def prefill_rows(res: list[dict], cfg: dict, pcp: int) -> list[dict]:
    """Table rows of part 3 from every rank's :func:`prefill_rank` result."""
    s = res[0]["samples"]
    rows = []
    for kind in ("sliding", "csa", "hca"):
        one, cp = s[f"{kind}_one"], s[f"{kind}_pcp"]
        c = harness.Comparison({"one": one, "cp": cp})
        rows.append({"kind": kind, "tokens": cfg["tokens"], "pcp": pcp, "heads": cfg["heads"], "topk": cfg["topk"],
                     "dtype": cfg["dtype"], "one_s": one.median, "pcp_s": cp.median,
                     "speedup": c.ratio("one", "cp").as_dict(), "cpu_speedup": c.ratio("one", "cp", "cpu").as_dict(),
                     "bytes_sent_per_rank": {k: max(x["sent"][kind].get(k, 0) for x in res)
                                             for k in sorted({k for x in res for k in x["sent"][kind]})}})
    return rows


def timed_rank(group, cfg: dict) -> dict:
    """Rank function of both timed parts (one set of gloo processes): decode over the group as DCP, then
    prefill over it as PCP."""
    return {"decode": decode_rank(group, cfg["decode"]), "prefill": prefill_rank(group, cfg["prefill"])}


# ----------------------------------------------------------------------------- main
def _parser():
    ap = harness.parser("cpattn bench v4", __doc__, timeout=True,
                        quick="4K decode context, 512-token prefill, 2 rounds: seconds")
    cli.add_parallel(ap, pcp=2, dcp=2)
    cli.add_dtype(ap, default="float32", help="dtype of the prefill part (the decode part runs bf16 and fp32)")
    ap.add_argument("--context", type=cli.positive_int, default=None,
                    help="decode context in tokens (default 65536; 4096 with --quick)")
    ap.add_argument("--batch", type=cli.positive_int, default=None,
                    help="decode requests per step, each at the full context (default 4; 1 with --quick)")
    ap.add_argument("--prefill-tokens", type=cli.positive_int, default=None,
                    help="prefill length in tokens (default 16384; 512 with --quick)")
    ap.add_argument("--reps", type=cli.positive_int, default=None,
                    help="interleaved timing rounds (default 3; 2 with --quick)")
    return ap


def main(argv=None) -> int:
    """``cpattn bench v4``: KV bytes per token, decode one rank vs DCP, prefill one rank vs PCP (``--json``)."""
    ap = _parser()
    args = ap.parse_args(argv)
    pcp, dcp = args.prefill_context_parallel_size, args.decode_context_parallel_size
    for flag, v in (("--prefill-context-parallel-size/--pcp", pcp), ("--decode-context-parallel-size/--dcp", dcp)):
        if v < 2:
            cli.bad_value(ap.prog, flag, v, "at least 2 (compared against one rank)", "pass 2 or more")
    if pcp != dcp:
        cli.bad_value(ap.prog, "--pcp/--dcp", f"{pcp}/{dcp}", "equal sizes (one set of gloo ranks times both parts)",
                      f"pass --pcp {dcp} --dcp {dcp}")
    cli.check_engine(ap.prog, tp_size=dcp, dcp_size=dcp, attention="v4", num_attention_heads=HEADS, num_kv_heads=1)
    cli.check_engine(ap.prog, pcp_size=pcp, attention="v4")
    import torch

    torch.manual_seed(0)
    sizes = dict(decode_ctx=4096, batch=1, prefill=512, reps=2) if args.quick else \
        dict(decode_ctx=65536, batch=4, prefill=16384, reps=3)
    sizes.update({k: v for k, v in (("decode_ctx", args.context), ("batch", args.batch),
                                    ("prefill", args.prefill_tokens), ("reps", args.reps)) if v is not None})
    with harness.Report(args) as out:
        out.payload = _run(out, args, pcp, dcp, sizes)
    return 0


def _mb(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def _run(out, args, pcp: int, dcp: int, sizes: dict) -> dict:
    kv = kv_rows((65536, 1048576), dcp)
    src = sources()
    out.line("\nKV bytes per request, bf16 (exact counts; what one request keeps between decode steps)")
    out.table([{"context": r["context"], "V4 MB": _mb(r["v4"]), "V3.2 MB": _mb(r["v32"]), "MLA MB": _mb(r["mla"]),
                "V4 B/tok": f"{r['v4_per_token']:.1f}", "V3.2 B/tok": f"{r['v32_per_token']:.0f}",
                "MLA B/tok": f"{r['mla_per_token']:.0f}", "V4/V3.2": f"{r['v4'] / r['v32']:.4f}",
                "V4/MLA": f"{r['v4'] / r['mla']:.4f}", f"V4 MB/rank DCP{dcp}": _mb(r[f"v4_per_rank_dcp{dcp}"]),
                "V3.2 MB/rank": _mb(r[f"v32_per_rank_dcp{dcp}"])} for r in kv],
              ["context", "V4 MB", "V3.2 MB", "MLA MB", "V4 B/tok", "V3.2 B/tok", "MLA B/tok", "V4/V3.2", "V4/MLA",
               f"V4 MB/rank DCP{dcp}", "V3.2 MB/rank"])
    for name in ("v4", "v32", "mla"):
        out.line(f"  {name}: transformers 5.24 {src[name]}")
    out.line(f"  sizes {src['checked']}; V4 counts equal HF's own cache after a prefill (tests/test_v4_kv_bytes.py)")
    big = kv[-1]["v4_parts_bytes"]
    out.line("  V4 at 1M tokens by part (MB): " + ", ".join(f"{k} {_mb(v)}" for k, v in big.items()))

    dtypes, heads = ["bfloat16", "float32"], HEADS // 8
    pre_cfg = {"tokens": sizes["prefill"], "heads": heads, "index_heads": H_I // 8, "topk": PREFILL_TOPK,
               "dtype": args.dtype, "reps": sizes["reps"]}
    dec_cfg = {"context": sizes["decode_ctx"], "batch": sizes["batch"], "dtypes": dtypes, "reps": sizes["reps"]}
    res = harness.ranks(dcp, timed_rank, {"decode": dec_cfg, "prefill": pre_cfg}, timeout_s=args.timeout,
                        label=f"decode one rank vs DCP {dcp}, then prefill one rank vs PCP {pcp}")
    dec = decode_rows([r["decode"] for r in res], sizes["decode_ctx"], dcp, dtypes, sizes["batch"])
    out.line(f"\nDecode step of one V4 attention layer, {sizes['decode_ctx']:,} context, batch {sizes['batch']}, "
             f"{HEADS} heads x {D}, "
             f"top-{TOPK} by {H_I}x{D_I} indexer: one rank vs DCP {dcp} (gloo, 1 thread per rank; ms: medians of "
             f"{sizes['reps']} interleaved rounds, slowest rank)")
    out.table([{"layer": r["kind"], "dtype": r["dtype"], "one ms": f"{r['one_ms']:.2f}", "DCP ms": f"{r['dcp_ms']:.2f}",
                "x wall [low-high]": str(Spread(**r["speedup"])), "best": f"{r['speedup']['best']:.2f}",
                "x cpu": f"{r['cpu_speedup']['median']:.2f}", "KV MB/rank": _mb(r["kv_bytes_per_rank"]),
                "sent KB/rank": f"{r['bytes_sent_per_rank'] / 1024:.1f}"} for r in dec],
              ["layer", "dtype", "one ms", "DCP ms", "x wall [low-high]", "best", "x cpu", "KV MB/rank",
               "sent KB/rank"])

    pre = prefill_rows([r["prefill"] for r in res], pre_cfg, pcp)
    out.line(f"\nPrefill of one V4 attention layer, {sizes['prefill']:,} tokens, {heads} heads x {D} (a TP 8 rank's "
             f"share), indexer {H_I // 8}x{D_I}, CSA top-{PREFILL_TOPK}, {args.dtype}: one rank vs PCP {pcp} (gloo, 1 "
             f"thread per rank; s: medians of {sizes['reps']} interleaved rounds)")
    sent = "sent per rank (bytes by collective)"
    out.table([{"layer": r["kind"], "one s": f"{r['one_s']:.3f}", "PCP s": f"{r['pcp_s']:.3f}",
                "x wall [low-high]": str(Spread(**r["speedup"])), "best": f"{r['speedup']['best']:.2f}",
                "x cpu": f"{r['cpu_speedup']['median']:.2f}",
                sent: ", ".join(f"{k} {v:,}" for k, v in r["bytes_sent_per_rank"].items())} for r in pre],
              ["layer", "one s", "PCP s", "x wall [low-high]", "best", "x cpu", sent])
    return {"kv_bytes": kv, "sources": src, "decode": dec, "prefill": pre, "quick": args.quick, "pcp": pcp,
            "dcp": dcp, "dtype": args.dtype}


if __name__ == "__main__":
    raise SystemExit(main())
