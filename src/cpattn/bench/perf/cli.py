"""``cpattn plan calibrate | validate | anchors``: the planner's experiments, on the benchmark harness.

``calibrate`` writes the CPU profile and never replaces an existing file
unless ``--out`` names it or ``--force`` is given (other processes read the
default one); ``validate`` compares predicted and measured ratios of
``cpattn bench pcp / dcp / graph``; ``anchors`` predicts the published
anchors. Usage errors are one line, exit 2, before any work. Each prints
through :class:`cpattn.bench.harness.Report` (``--json -``: only JSON on
stdout) and the model they price is the library's (:mod:`cpattn.plan`).
(Moved from ``cpattn.plan.cli_tools``, which re-exports these names.) ``cpattn plan calibrate ...``
reaches :func:`main` straight from :mod:`cpattn.cli`: the planner never imports its experiments.
"""

from __future__ import annotations

import contextlib
import math
import os

from cpattn.bench import harness
from cpattn.config import cli_args as cli
from cpattn.plan.cli import _profile


SUBCOMMANDS = ("calibrate", "validate", "anchors")


def main(argv: list[str]) -> int:
    """Run ``cpattn plan SUB ARGS`` for SUB in :data:`SUBCOMMANDS` (``argv = [SUB, *ARGS]``); the exit status.

    >>> main(["anchors", "--json", "-"])  # doctest: +ELLIPSIS
    {...
    0
    """
    if not argv or argv[0] not in SUBCOMMANDS:
        raise ValueError(f"cpattn.bench.perf.cli.main: argv[0] must be one of {SUBCOMMANDS}; got {argv[:1]}")
    return {"calibrate": _calibrate, "validate": _validate, "anchors": _anchors}[argv[0]](argv[1:])


# ----------------------------------------------------------------------------- calibrate
def _calibrate(argv) -> int:
    from cpattn.plan.profiles import CPU_PROFILE_PATH, save_profile

    ap = harness.parser("cpattn plan calibrate", "Fit the CPU profile from microbenchmarks on this machine.\n\n"
                        "An existing profile is never replaced unless asked: --out PATH writes PATH (replacing it), "
                        "--force replaces the default 'cpu' profile other processes read (written atomically).",
                        quick="smaller microbenchmarks, no inductor compile (~30 s)", timeout=300.0)
    ap.add_argument("--out", default=None, type=cli.output_file_made,
                    help=f"where the profile JSON goes (missing directories are made); default: the 'cpu' profile, "
                         f"{CPU_PROFILE_PATH}, only if it does not exist yet (or with --force)")
    ap.add_argument("--force", action="store_true", help="replace the existing default profile")
    a = ap.parse_args(argv)
    out = a.out or CPU_PROFILE_PATH
    if a.out is None and not a.force and os.path.exists(out):
        cli.bad_value(ap.prog, "--out", f"no --out, and the default profile {out} exists",
                      "calibrate never replaces an existing profile unless asked (other processes read it)",
                      "pass --force to replace it, or --out PATH to write another file")
    from cpattn.plan.breakeven import bench_break_even
    from cpattn.bench.perf.calibrate import calibrate, summary
    with harness.Report(a) as rep:
        prof = calibrate(quick=a.quick, timeout_s=a.timeout)
        save_profile(prof, out)
        rep.line(summary(prof))
        even = {c: bench_break_even(prof, clock=c) for c in ("wall", "cpu")}
        rep.line("PCP break-even of `cpattn bench pcp` (32 / 8 heads, head dim 128, P=2), predicted: " + "; ".join(
            f"{c} clock {'never below 128K tokens' if n is None else f'{n} tokens'}" for c, n in even.items())
              + " (check with cpattn bench pcp --seq-lens N at lengths around it)")
        rep.line(f"saved to {out}")
        rep.payload = prof.as_dict()
    return 0


# ----------------------------------------------------------------------------- validate
def _load(prog: str, flag: str, path, keys: tuple[str, ...]):
    """A benchmark's ``--json`` output, or None; a usage error (one line, exit 2) for a file that is not one."""
    import json

    if path is None:
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        cli.bad_value(prog, flag, repr(path), "a readable JSON file", f"check the file ({e})")
    except json.JSONDecodeError as e:
        cli.bad_value(prog, flag, repr(path), f"JSON ({e.msg} at line {e.lineno})",
                      "pass what `cpattn bench ... --json PATH` wrote")
    missing = [k for k in keys if not isinstance(data, dict) or k not in data]
    if missing:
        cli.bad_value(prog, flag, repr(path), f"the --json output of its benchmark (it lacks {missing[0]!r})",
                      f"pass what `cpattn bench {flag[2:].split('-')[0]} --json PATH` wrote")
    return data


@contextlib.contextmanager
def _reading(prog: str, flag: str, path):
    """Within the block, a benchmark output that lacks or mistypes a field is a usage error naming ``flag``."""
    try:
        yield
    except (KeyError, TypeError, IndexError, ValueError) as e:
        cli.bad_value(prog, flag, repr(path), f"the --json output of its benchmark (it lacks or mistypes {e})",
                      f"pass what `cpattn bench {flag[2:].split('-')[0]} --json PATH` wrote")


def _validate(argv) -> int:
    ap = cli.parser("cpattn plan validate", "Predicted vs measured ratios of cpattn bench pcp / dcp / graph.")
    ap.add_argument("--profile", default="cpu", help="the calibrated CPU profile (default) or a profile JSON")
    ap.add_argument("--pcp-json", default=None, type=cli.input_file, help="cpattn bench pcp --json output (its spec is predicted)")
    ap.add_argument("--dcp-json", default=None, type=cli.input_file, help="cpattn bench dcp --json output")
    ap.add_argument("--graph-json", default=None, type=cli.input_file, help="cpattn bench graph --json output")
    ap.add_argument("--pcp-seq", type=cli.positive_int, default=16384, help="without --pcp-json: tokens")
    ap.add_argument("--pcp-heads", default="32,8", help="without --pcp-json: query,kv heads")
    ap.add_argument("--dcp-context", type=cli.positive_int, default=65536, help="context of the dcp ratio")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: wall-clock ratios (slowest rank); cpu: process CPU-time ratios (slowest rank), "
                         "predicted with the CPU-time shares and transfer costs (bench graph has wall ratios only)")
    cli.add_json(ap)
    a = ap.parse_args(argv)
    pcp = _load(ap.prog, "--pcp-json", a.pcp_json, ("spec", "world_size"))  # every input checked before any work
    dcp = _load(ap.prog, "--dcp-json", a.dcp_json, ("config", "dcp"))
    graph = _load(ap.prog, "--graph-json", a.graph_json, ("config",))
    prof = _profile(ap.prog, a.profile)
    from cpattn.bench.perf import validate as v
    from cpattn.plan import bench_model as m

    pairs, detail = [], {}
    if pcp is not None:
        with _reading(ap.prog, "--pcp-json", a.pcp_json):
            s = pcp["spec"]
            seq, heads, kvh, d, p = sum(s["seq_lens"]), s["heads"], s["kv_heads"], s["head_dim"], pcp["world_size"]
    else:
        seq, (heads, kvh), d, p = a.pcp_seq, (int(x) for x in a.pcp_heads.split(",")), 128, 2
    pr = m.predict_pcp(prof, seq=seq, heads=heads, kv_heads=kvh, head_dim=d, pcp=p, clock=a.clock)
    detail["pcp"] = pr
    with _reading(ap.prog, "--pcp-json", a.pcp_json):
        pairs.append((f"bench pcp: ring / one rank ({seq} tokens, {heads}/{kvh} heads, P={p}), {a.clock}",
                      pr["ratio"], None if pcp is None else v.measured_pcp(pcp, a.clock), 1 / p))
    ctx = a.dcp_context
    if dcp is not None:
        with _reading(ap.prog, "--dcp-json", a.dcp_json):
            c = dcp["config"]
            ctx = ctx if ctx in c["contexts"] else c["contexts"][-1]
            dr = m.predict_dcp(prof, context=ctx, batch=c["batch"], heads=c["hq"], kv_heads=c["hkv"],
                               head_dim=c["d"], dcp=dcp["dcp"], kv_bytes=2 if c["dtype"] in ("bfloat16", "float16")
                               else 4, clock=a.clock)
            meas = v.measured_dcp(dcp, ctx, a.clock)
    else:
        dr, meas = m.predict_dcp(prof, context=ctx, clock=a.clock), {}
    detail["dcp"] = dr
    for k, val in dr["ratio"].items():
        pairs.append((f"bench dcp: whole step {k} / one rank ({ctx} context), {a.clock}", val, meas.get(k),
                      1 / (dcp["dcp"] if dcp is not None else 2)))
    if graph is not None:
        with _reading(ap.prog, "--graph-json", a.graph_json):
            c = graph["config"]
            gr = m.predict_graph(prof, layers=c["layers"], batches=tuple(c["batches"]),
                                 dcp=c["decode_context_parallel_size"], merge=c["merge"], hidden=c["hidden"],
                                 heads=c["heads"], kv_heads=c["kv_heads"], head_dim=c["head_dim"], context=c["context"])
            meas_g = v.measured_graph(graph)
    else:
        gr, meas_g = m.predict_graph(prof), {}
    detail["graph"] = gr
    for b, val in gr.items():
        pairs.append((f"bench graph: eager / graph, batch {b}, wall", val["speedup"], meas_g.get(b)))
    rows, gaps = v.table(pairs), m.profile_gaps(prof)
    from cpattn.plan.breakeven import bench_break_even

    keep = v.where_the_model_earns_its_keep(rows, bench_break_even(prof, heads=heads, kv_heads=kvh, head_dim=d,
                                                                   pcp=p, clock=a.clock), a.clock)
    with harness.Report(a) as rep:
        print(f"profile: {prof.device}")
        pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
        shown = [{**r, "error": pct(r["error"]), "naive_error": pct(r["naive_error"]),
                  "measured": "-" if r["measured"] is None else r["measured"],
                  "naive": "-" if r["naive"] is None else r["naive"]} for r in rows]
        rep.table(shown, ["what", "predicted", "measured", "error", "naive", "naive_error"])
        worst = max((r["error"] for r in rows if r["error"] is not None), default=math.nan)
        print(f"\nlargest error {worst:.1%} (target: within 15%)" if not math.isnan(worst) else
              "\n(no measured values given: pass the benchmarks' --json outputs)")
        judged = [r for r in rows if r["naive_error"] is not None]
        if judged:
            print(f"naive 1/P guess (PCP and DCP rows): within 15% on "
                  f"{sum(r['naive_within_15%'] for r in judged)} of {len(judged)}; the model on "
                  f"{sum(r['within_15%'] for r in judged)} of {len(judged)}")
        print(keep["line"])
        one = detail["pcp"]["one_rank_s"]
        print(f"\nwhere a PCP rank's time goes (predicted, of one rank's {one:.3g} s; before the share of the "
              f"shared cores, {detail['pcp']['share']:.0%}): " +
              "; ".join(f"rank {r}: " + ", ".join(f"{k} {x / one:.3g}" for k, x in parts.items())
                        for r, parts in enumerate(detail["pcp"]["ranks"])))
        print(f"DCP: a rank keeps {detail['dcp']['share']:.0%} of its decode bandwidth while both decode; "
              "graph (eager / graph ms, of which collectives, eager's cold extra): " +
              "; ".join(f"batch {b}: {g['eager_s'] * 1e3:.1f} / {g['graph_s'] * 1e3:.1f}, {g['comm_s'] * 1e3:.1f}, "
                        f"{g['cold_s'] * 1e3:.1f}" for b, g in detail["graph"].items()))
        if gaps:
            print("\nthis profile predates some calibrated numbers; standing in:")
            for line in gaps:
                print(f"  - {line}")
        rep.payload = {"profile": prof.name, "clock": a.clock, "rows": rows, "detail": detail, "earns_keep": keep,
                       "profile_gaps": gaps}
    return 0


# ----------------------------------------------------------------------------- anchors
def _anchors(argv) -> int:
    from cpattn.bench.perf import anchors

    ap = cli.parser("cpattn plan anchors", "The published anchors, predicted, with their assumptions.")
    cli.add_json(ap)
    a = ap.parse_args(argv)
    pcp = anchors.pcp_anchor()
    v4 = anchors.v4_anchor()
    sgl = anchors.sglang_cp_anchor()
    dcp = anchors.dcp_anchor()
    no_hit = anchors.dcp_anchor(prefix_hit=0.0)
    llama = anchors.llama_anchor()
    with harness.Report(a) as rep:
        lo, hi = anchors.PCP_RANGE
        print(f"PCP = 2 TTFT reduction, prefill instances of 16 Ascend 910C (A3), DP2 TP8 -> PCP2 TP8, EP16 "
              f"(published {lo:.0%}-{hi:.0%}; 'fitted': two scales fitted to the published baseline TTFTs):")
        pct = ("published_reduction", "ttft_reduction", "fitted_reduction")
        pts = ("error", "fitted_error")  # percentage points against the same cell's published reduction
        print(harness.table([{**r, **{k: f"{r[k]:.1%}" for k in pct}, **{k: f"{100 * r[k]:+.1f} pts" for k in pts}}
                     for r in pcp],
                    ["model", "context", "published_base_s", "published_reduction", "ttft_reduction", "error",
                     "in_range", "fitted_base_s", "fitted_reduction", "fitted_error", "fitted_in_range"]))
        print("\nabsolute (predicted / published TTFT, no fitting):")
        print(harness.table([{"model": r["model"], "context": r["context"], "published_base_s": r["published_base_s"],
                      "predicted_base_s": r["ttft_base_s"], "base": f"x{r['abs_base']:.2f}",
                      "published_pcp_s": r["published_pcp_s"], "predicted_pcp_s": r["ttft_pcp2_s"],
                      "pcp": f"x{r['abs_pcp']:.2f}"} for r in pcp],
                    ["model", "context", "published_base_s", "predicted_base_s", "base", "published_pcp_s",
                     "predicted_pcp_s", "pcp"]))
        lo, hi = anchors.DCP_RANGE
        print(f"\nDCP8 over TP8, Kimi-K2 on 8 x B200, tokens/s per GPU (published {dcp['published']['ratio']:.2f}x, "
              f"range {lo}-{hi}x): predicted {dcp['ratio']:.2f}x (concurrency {dcp['tp8']['concurrency']} -> "
              f"{dcp['tp8_dcp8']['concurrency']}, TPOT {dcp['tp8']['tpot_s'] * 1e3:.1f} -> "
              f"{dcp['tp8_dcp8']['tpot_s'] * 1e3:.1f} ms); in range: {dcp['in_range']}")
        pub = dcp["published"]
        print(f"  absolute tokens/s per GPU: TP8 {dcp['tp8']['tokens_per_s_per_gpu']:.0f} (published {pub['tp8']}, "
              f"x{dcp['abs']['tp8']:.1f}), TP8+DCP8 {dcp['tp8_dcp8']['tokens_per_s_per_gpu']:.0f} (published "
              f"{pub['tp8_dcp8']}, x{dcp['abs']['tp8_dcp8']:.1f}); without the assumed {dcp['prefix_hit']:.0%} "
              f"prefix-cache hits the ratio is {no_hit['ratio']:.2f}x")
        print(f"\nLlama3-405B, one {llama['context']:,}-token prompt on 128 H100 (TP8 x CP16 ring; arXiv "
              f"2411.01783): predicted {llama['ttft_s']:.1f} s, published {llama['published_s']:.0f} s "
              f"(x{llama['abs']:.2f})")
        print("\nDeepSeek-V4 PCP2 (vLLM #43809, TTFT of one prompt; modelled: V4-Flash on 8 x B200, fp8): predicted / "
              "published, and the TTFT reduction (predicted vs published):")
        print(harness.table([{"context": r["context"], "published_base_s": r["published_base_s"],
                      "predicted_tp8_s": r["ttft_tp8_s"], "base": f"x{r['abs_base']:.3f}",
                      "published_pcp_s": r["published_pcp_s"], "predicted_tp4_pcp2_s": r["ttft_tp4_pcp2_s"],
                      "pcp": f"x{r['abs_pcp']:.3f}", "published_reduction": f"{r['published_reduction']:.1%}",
                      "ttft_reduction": f"{r['ttft_reduction']:.1%}", "error": f"{100 * r['error']:+.1f} pts",
                      "tp8_pcp2 (16 GPUs)": f"{r['ttft_reduction_16']:.1%}"} for r in v4],
                    ["context", "published_base_s", "predicted_tp8_s", "base", "published_pcp_s",
                     "predicted_tp4_pcp2_s", "pcp", "published_reduction", "ttft_reduction", "error",
                     "tp8_pcp2 (16 GPUs)"]))
        pub = sgl["published"]
        print(f"\nSGLang static CP vs attention TP, one request (sglang #37944, GLM-5.2-FP8, CP4; modelled: GLM-5 "
              f"fp8 on 8 x H200, {sgl['cp']} vs {sgl['baseline']}): break-even predicted {sgl['break_even']} "
              f"tokens, published ~{pub['break_even']} (x{sgl['break_even_ratio']:.2f}); published CP "
              f"{pub['slowdown'][0]:.0%}-{pub['slowdown'][1]:.0%} slower below ~{pub['slower_below']}, predicted "
              + ", ".join(f"{n}: {x['slowdown']:+.1%}" for n, x in sgl["at"].items() if n <= pub["slower_below"]))
        print("\nassumptions:")
        for line in anchors.ASSUMPTIONS:
            print(f"  - {line}")
        rep.payload = {"pcp": pcp, "v4": v4, "sglang": sgl, "dcp": dcp, "dcp_no_prefix_hit": no_hit, "llama": llama,
                       "assumptions": anchors.ASSUMPTIONS}
    return 0
