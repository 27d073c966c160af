"""Benchmark: a hybrid linear-attention model (Qwen3-Next) under PCP prefill and DCP decode, on gloo ranks.

The model is a small Qwen3-Next (:func:`bench_config`: 4 layers, linear, linear, linear, full attention,
hidden 256, attention 4 query / 2 KV heads of 64, linear 2 key / 4 value heads of 64, dense MLPs), seeded
weights, one request. Every part runs on the same gloo ranks (one thread each); the one-rank variant runs
on rank 0 while the other ranks wait, the samples of both taken in interleaved rounds (A B, B A, ...), each
sample the slowest rank's. Ratios are PCP / one rank (or DCP / one rank) per round: median [low-high].

Part 1 -- prefill TTFT (first-token logits of a ``--prefill-tokens`` prompt; default 16384, 2048 with
``--quick``; both dtypes): PCP 2 (head-tail; the attention
layer by ring attention, the linear layers by the scan of chunk summaries over the same local tokens) vs
one rank. Checked: the first token equal, the first-token
logits' relative difference printed.

Part 2 -- what the scan's extra pass costs, one linear layer's delta rule at the same length: the plain
chunked op over the whole sequence (one rank), the plain chunked op over one rank's half (what PCP would
cost with no extra work), and the PCP scan over the half (the chunk tensors once, the summaries -- zero-start
state loop and transition product -- of the parts after segment 0, the summary all-gather, the fold, then the
state loop and outputs from the true start states).

Every ratio is given twice: by wall time and by CPU time (``cpu ...``: each rank's process CPU seconds,
the slowest rank's, per round). On a shared machine where the two ranks do not each get a core, the wall
ratio measures the contention; the CPU ratio is each rank's work, a gloo wait counting as far as gloo spins.

Part 3 -- bytes each rank sends in the PCP prefill (exact, from the group's counters): per linear layer the
summaries' all-gather (the state exchange) and the conv halos, per attention layer the ring's KV exchange;
with the hand counts they must equal (``(P-1) * parts * Hv * Dk * (Dk + Dv) * 4`` for the summaries,
``(P-1) * parts * (K-1) * (C+1) * itemsize`` for the halos, ``(P-1) * T/P * Hkv * 2 * head_dim * itemsize``
for the ring).

Part 4 -- decode TPOT at ``--context`` tokens (default 32768, 4096 with ``--quick``): one decode step
(the attention layer over a filled paged cache, the linear layers' recurrent op on their states) DCP 2 vs
one rank, the same seeded cache rows placed in both. Checked: the next token equal.

Both dtypes, fp32 and bf16 (as the models run), at the same lengths (``prefill_by_dtype`` in the JSON
names them per dtype).

Usage::

    cpattn bench hybrid                 # 16K prefill, 32K decode, fp32 and bf16: about 2 minutes
    cpattn bench hybrid --quick         # 2K prefill, 4K decode, 2 rounds: under a minute
    cpattn bench hybrid --json -        # JSON alone on stdout, the text report on stderr
"""

from __future__ import annotations

import statistics

from cpattn.bench import harness
from cpattn.config import cli_args as cli

DTYPES = ("float32", "bfloat16")
PREFILL_COLUMNS = ["dtype", "tokens", "one_s", "pcp_s", "pcp/one [low-high]", "cpu pcp/one", "token_equal",
                   "logits_rel"]
SCAN_COLUMNS = ["dtype", "tokens", "plain_full_ms", "plain_half_ms", "scan_ms", "scan/plain_half [low-high]",
                "cpu scan/plain_half"]
BYTES_COLUMNS = ["dtype", "what", "layers", "bytes_per_layer", "bytes", "hand_count"]
DECODE_COLUMNS = ["dtype", "context", "one_ms", "dcp_ms", "dcp/one [low-high]", "token_equal", "kv_bytes_one",
                  "kv_bytes_rank", "state_bytes"]


def bench_config(**over):
    """The benchmark's model: small enough for 16K tokens on a CPU core, real head sizes (64).

    >>> c = bench_config()
    >>> c.layer_types.count("linear_attention"), c.conv_channels
    (3, 512)
    """
    from cpattn.models.qwen3_next import Qwen3NextConfig

    base = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64,
                layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
                linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                num_experts=0, num_experts_per_tok=0, max_position_embeddings=65536)
    return Qwen3NextConfig(**{**base, **over})


def hand_bytes(cfg, tokens: int, pcp: int, itemsize: int) -> dict[str, int]:
    """Bytes one rank sends per layer in a head-tail PCP prefill of one request of ``tokens`` (``tokens``
    divisible by 2 * pcp): ``state`` (summaries, float32), ``halo`` (conv tails + valid flag, in the model's
    dtype), ``kv`` (the ring: every other rank's K and V rows once).

    >>> hand_bytes(bench_config(), 16384, 2, 4)
    {'state': 262144, 'halo': 12312, 'kv': 8388608}
    """
    parts = 2  # head-tail: two segments per rank
    dk, dv, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    state = (pcp - 1) * parts * hv * dk * (dk + dv) * 4
    halo = (pcp - 1) * parts * (cfg.linear_conv_kernel_dim - 1) * (cfg.conv_channels + 1) * itemsize
    kv = (pcp - 1) * (tokens // pcp) * cfg.num_key_value_heads * 2 * cfg.head_dim * itemsize
    return {"state": state, "halo": halo, "kv": kv}


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _params(cfg, dtype):
    from cpattn.models import qwen3_next as qn

    return qn.init_params(cfg, seed=0, std=0.05, dtype=dtype)


def prefill_part(group, cfg, params, tokens: int, reps: int) -> dict:
    """Part 1 and 3 on this rank: TTFT one rank vs PCP, then the bytes of one PCP prefill by collective."""
    import torch
    from cpattn.comm.sim import SimMesh
    from cpattn.engine.backends.hybrid import hybrid_prefill
    from cpattn.engine.batch import Prompts
    from cpattn.models.family import get_family

    family = get_family("qwen3_next")
    prompt = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = Prompts.of([prompt])
    solo = SimMesh(1).groups()[0]
    with torch.no_grad():
        one = hybrid_prefill(solo, family, params, cfg, prompts).first_logits if group.rank == 0 else None
        group.stats.reset()
        pcp = hybrid_prefill(group, family, params, cfg, prompts).first_logits
        sent = dict(group.stats.bytes_sent)
        runs = {"one": (lambda: hybrid_prefill(solo, family, params, cfg, prompts)) if group.rank == 0
                else (lambda: None),
                "pcp": lambda: hybrid_prefill(group, family, params, cfg, prompts)}
        c = harness.compare(runs, reps, group=group)
    out = {"samples": c.samples, "order": c.order, "sent": sent}
    if group.rank == 0:
        out.update(token_equal=bool(torch.equal(one.argmax(-1), pcp.argmax(-1))), logits_rel=_rel(pcp, one))
    return out


def scan_part(group, cfg, dtype, tokens: int, reps: int) -> dict:
    """Part 2 and the per-layer linear bytes on this rank: one linear layer's delta rule."""
    import torch
    from cpattn.linear import ScanLayout, pcp_causal_conv1d, pcp_gated_delta, scan_shard
    from cpattn.ops import gated_delta as gd

    gen = torch.Generator().manual_seed(2)
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    q, k = (torch.randn(tokens, hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(tokens, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(tokens, hv, generator=gen) * 0.2
    beta = torch.rand(tokens, hv, generator=gen).to(dtype)
    x = torch.randn(tokens, cfg.conv_channels, generator=gen).to(dtype)
    w = torch.randn(cfg.conv_channels, cfg.linear_conv_kernel_dim, generator=gen).to(dtype)
    s0 = torch.zeros(1, hv, dk, dv)
    cu = [0, tokens]
    lay = ScanLayout.head_tail(group.size)
    idx, parts = scan_shard(cu, lay, group.rank)
    half = torch.tensor([0, idx.numel()], dtype=torch.int32)
    scale = dk**-0.5
    conv0 = torch.zeros(1, cfg.linear_conv_kernel_dim - 1, cfg.conv_channels, dtype=dtype)

    def plain(sl, cu_t):
        return gd.gated_delta_chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], cu_t, s0, scale=scale)

    def scan():
        return pcp_gated_delta(group, lay, q[idx], k[idx], v[idx], g[idx], beta[idx], parts, s0, scale=scale)

    full = torch.tensor(cu, dtype=torch.int32)
    runs = {"plain_full": (lambda: plain(slice(None), full)) if group.rank == 0 else (lambda: None),
            "plain_half": lambda: plain(idx, half), "scan": scan}
    with torch.no_grad():
        c = harness.compare(runs, reps, group=group)
        group.stats.reset()
        scan()
        state = group.stats.total_sent()
        group.stats.reset()
        pcp_causal_conv1d(group, lay, x[idx], w, None, parts, conv0, silu=True)
        halo = group.stats.total_sent()
    return {"samples": c.samples, "order": c.order, "state_bytes": state, "halo_bytes": halo}


def decode_part(group, cfg, params, context: int, reps: int) -> dict:
    """Part 4 on this rank: one decode step at ``context`` tokens, one rank (rank 0) vs DCP over ``group``."""
    import torch
    from cpattn.comm.sim import SimMesh
    from cpattn.engine import driver
    from cpattn.engine.backends.hybrid import HYBRID, HybridProgram
    from cpattn.engine.batch import Prompts
    from cpattn.engine.handoff import place_rows
    from cpattn.engine.kv_rows import row_width
    from cpattn.models.family import get_family

    family = get_family("qwen3_next")
    dtype = params["model.embed_tokens.weight"].dtype
    prompts = Prompts.of([[0] * context])
    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(context, row_width(family.kv_layouts(cfg)), generator=gen) * 0.5).to(dtype)
    states = family.recurrent_cache(cfg, batch=1, dtype=dtype)
    for t in (*states.conv, *states.state):
        t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    req, pos = torch.zeros(context, dtype=torch.int64), torch.arange(context)

    def program(g):
        _, dec = driver.engine_configs("qwen3_next", cfg, dcp_size=g.size, block_size=16)
        cache = HYBRID.new_cache(family, cfg, params, prompts, 4, dec, 0, g)
        place_rows(cache.shard, rows, req, pos, rank=g.rank, dcp_size=g.size)
        cache.set_states(states)
        prog = HybridProgram(family, cfg, g, params, cache)
        batch = prog.batch([0], [context], torch.tensor([7]))
        batch["cu_seqlens_q"] = torch.tensor([0, 1], dtype=torch.int32)  # one token, one request
        return prog, batch, cache

    with torch.no_grad():
        dcp, dbatch, dcache = program(group)
        first_dcp = dcp.step(dcp.state, dbatch)[1]
        runs = {"dcp": lambda: dcp.step(dcp.state, dbatch)}
        out = {"kv_bytes_rank": dcache.attention_kv_bytes(), "state_bytes": dcache.state_bytes()}
        if group.rank == 0:
            one, obatch, ocache = program(SimMesh(1).groups()[0])
            first_one = one.step(one.state, obatch)[1]
            runs["one"] = lambda: one.step(one.state, obatch)
            out.update(token_equal=bool(torch.equal(first_one, first_dcp)), kv_bytes_one=ocache.attention_kv_bytes())
        else:
            runs["one"] = lambda: None
        c = harness.compare({"one": runs["one"], "dcp": runs["dcp"]}, reps, group=group, inner=3)
    out.update(samples=c.samples, order=c.order)
    return out


def bench_rank(group, cfg_over: dict, sizes: dict) -> dict:
    """Rank function: every part, for each dtype."""
    import torch
    from cpattn.bench.common import DTYPES as NAMES

    cfg = bench_config(**cfg_over)
    out = {}
    for name in sizes["dtypes"]:
        dtype = NAMES[name]
        params = _params(cfg, dtype)
        torch.manual_seed(0)
        n = sizes["prefill_by_dtype"][name]
        out[name] = {"prefill": prefill_part(group, cfg, params, n, sizes["reps"]),
                     "scan": scan_part(group, cfg, dtype, n, sizes["reps"]),
                     "decode": decode_part(group, cfg, params, sizes["context"], sizes["reps"])}
    return out


def _spread(s) -> str:
    return f"{s.median:.3g} [{s.low:.3g}-{s.high:.3g}]"


def rows_of(res: list[dict], cfg, sizes: dict, pcp: int) -> dict[str, list[dict]]:
    """The four tables' rows from every rank's :func:`bench_rank` result (samples: the slowest rank's)."""
    from cpattn.bench.common import DTYPES as NAMES

    pre, scan, nbytes, dec = [], [], [], []
    n_lin, n_full = len(cfg.layer_slots("linear_attention")), len(cfg.layer_slots("full_attention"))
    for name in sizes["dtypes"]:
        r0 = res[0][name]
        p, s, d = r0["prefill"], r0["scan"], r0["decode"]
        ratio = harness.Comparison(p["samples"]).ratio("pcp", "one")
        tokens = sizes["prefill_by_dtype"][name]
        cpu = harness.Comparison(p["samples"]).ratio("pcp", "one", clock="cpu")
        pre.append({"dtype": name, "tokens": tokens, "pcp": pcp, "one_s": p["samples"]["one"].median,
                    "pcp_s": p["samples"]["pcp"].median, "ratio": ratio.as_dict(),
                    "pcp/one [low-high]": _spread(ratio), "cpu_ratio": cpu.as_dict(), "cpu pcp/one": _spread(cpu),
                    "one_cpu_s": statistics.median(p["samples"]["one"].cpu),
                    "pcp_cpu_s": statistics.median(p["samples"]["pcp"].cpu),
                    "token_equal": p["token_equal"],
                    "logits_rel": p["logits_rel"], "order": p["order"]})
        sr = harness.Comparison(s["samples"]).ratio("scan", "plain_half")
        sc = harness.Comparison(s["samples"]).ratio("scan", "plain_half", clock="cpu")
        scan.append({"dtype": name, "tokens": tokens,
                     "plain_full_ms": 1e3 * s["samples"]["plain_full"].median,
                     "plain_half_ms": 1e3 * s["samples"]["plain_half"].median,
                     "scan_ms": 1e3 * s["samples"]["scan"].median, "ratio": sr.as_dict(),
                     **{f"{k}_cpu_ms": 1e3 * statistics.median(s["samples"][k].cpu) for k in ("plain_full",
                                                                                           "plain_half", "scan")},
                     "scan/plain_half [low-high]": _spread(sr), "cpu_ratio": sc.as_dict(),
                     "cpu scan/plain_half": _spread(sc), "order": s["order"]})
        hand = hand_bytes(cfg, tokens, pcp, NAMES[name].itemsize)
        sent = max((x[name]["prefill"]["sent"] for x in res), key=lambda v: sum(v.values()))
        state = max(x[name]["scan"]["state_bytes"] for x in res)
        halo = max(x[name]["scan"]["halo_bytes"] for x in res)
        kv = sent.get("ring", 0) // max(n_full, 1)
        for what, layers, per, h in (("state exchange (summaries)", n_lin, state, hand["state"]),
                                     ("conv halos", n_lin, halo, hand["halo"]),
                                     ("attention KV (ring)", n_full, kv, hand["kv"])):
            nbytes.append({"dtype": name, "what": what, "layers": layers, "bytes_per_layer": per,
                           "bytes": per * layers, "hand_count": h * layers})
        nbytes.append({"dtype": name, "what": "prefill total (by collective)", "layers": n_lin + n_full,
                       "bytes_per_layer": "", "bytes": sum(sent.values()), "hand_count": "", "by_collective": sent})
        dr = harness.Comparison(d["samples"]).ratio("dcp", "one")
        dec.append({"dtype": name, "context": sizes["context"], "dcp": pcp, "one_ms": 1e3 * d["samples"]["one"].median,
                    "dcp_ms": 1e3 * d["samples"]["dcp"].median, "ratio": dr.as_dict(),
                    "dcp/one [low-high]": _spread(dr), "token_equal": d["token_equal"],
                    "kv_bytes_one": d["kv_bytes_one"], "kv_bytes_rank": max(x[name]["decode"]["kv_bytes_rank"]
                                                                            for x in res),
                    "state_bytes": d["state_bytes"], "order": d["order"]})
    return {"prefill": pre, "scan": scan, "bytes": nbytes, "decode": dec}


def main(argv=None) -> int:
    """``cpattn bench hybrid``: prefill PCP vs one rank, the scan's cost, bytes, decode DCP vs one rank."""
    p = harness.parser("cpattn bench hybrid", __doc__, quick="2K prefill, 4K decode context, 2 rounds",
                       timeout=1800.0)
    p.add_argument("--prefill-tokens", type=cli.positive_int, default=None,
                   help="prompt tokens of the prefill parts (default 16384; 2048 with --quick)")
    p.add_argument("--context", type=cli.positive_int, default=None,
                   help="decode context in tokens (default 32768; 4096 with --quick)")
    p.add_argument("--reps", type=cli.positive_int, default=None, help="interleaved rounds (default 3; 2 quick)")
    p.add_argument("--ranks", type=cli.positive_int, default=2, help="PCP = DCP size (gloo ranks, 1 thread each)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of float32,bfloat16")
    args = p.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        cli.bad_value(p.prog, "--dtypes", args.dtypes, f"a comma-separated subset of {','.join(DTYPES)}",
                      "pass --dtypes float32 or --dtypes float32,bfloat16")
    if args.ranks < 2:
        cli.bad_value(p.prog, "--ranks", args.ranks, "at least 2 (compared against one rank)", "pass --ranks 2")
    sizes = dict(prefill=2048, context=4096, reps=2) if args.quick else dict(prefill=16384, context=32768, reps=3)
    sizes.update({k: v for k, v in (("prefill", args.prefill_tokens), ("context", args.context),
                                    ("reps", args.reps)) if v is not None})
    if sizes["prefill"] % (2 * args.ranks):
        cli.bad_value(p.prog, "--prefill-tokens", sizes["prefill"], f"a multiple of {2 * args.ranks} (2 x ranks: "
                      "head-tail chunks of equal size, so the hand byte counts are exact)", "pass e.g. 16384")
    sizes["dtypes"] = dtypes
    sizes["prefill_by_dtype"] = {d: sizes["prefill"] for d in dtypes}
    cfg = bench_config()
    with harness.Report(args) as out:
        res = harness.ranks(args.ranks, bench_rank, {}, sizes, timeout_s=args.timeout,
                            label=f"hybrid prefill {sizes['prefill_by_dtype']} / decode {sizes['context']}")
        rows = rows_of(res, cfg, sizes, args.ranks)
        n = args.ranks
        out.line(f"Qwen3-Next (bench_config: {cfg.num_hidden_layers} layers {'/'.join(t[0] for t in cfg.layer_types)}"
                 f", hidden {cfg.hidden_size}, attention {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads x "
                 f"{cfg.head_dim}, linear {cfg.linear_num_key_heads}/{cfg.linear_num_value_heads} heads x "
                 f"{cfg.linear_key_head_dim}); gloo, {n} ranks x 1 thread; medians of {sizes['reps']} interleaved "
                 f"rounds (slowest rank), ratios per round median [low-high]")
        out.line(f"\nPrefill TTFT (tokens per dtype in the table): PCP {n} vs one rank (issue target pcp/one <= 0.58)")
        out.table(rows["prefill"], PREFILL_COLUMNS)
        out.line(f"\nOne linear layer's delta rule at the prefill's length: plain chunked op (whole sequence, and "
                 f"one rank's 1/{n}) vs the PCP scan (summaries + all-gather + fold + outputs)")
        out.table(rows["scan"], SCAN_COLUMNS)
        out.line(f"\nBytes sent per rank in one PCP {n} prefill (group counters; hand_count from the config)")
        out.table(rows["bytes"], BYTES_COLUMNS)
        out.line(f"\nDecode TPOT, {sizes['context']:,} context: DCP {n} vs one rank (ms per step; kv bytes: the "
                 "attention KV, states replicated on every rank)")
        out.table(rows["decode"], DECODE_COLUMNS)
        out.line(f"(run {out.elapsed:.0f} s)")
        out.payload = {"config": {**sizes, "ranks": n, "quick": args.quick}, "model": cfg.to_hf(), **rows}
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
