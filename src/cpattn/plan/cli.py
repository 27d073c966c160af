"""``cpattn plan``: the layout to run for your objective, priced on hardware we do not have.

Usage::

    cpattn plan --model deepseek-r1 --input-len 131072 --devices 8 --profile h200 --objective ttft
    cpattn plan --model deepseek-r1 --input-len 131072 --devices 8 --objective tpot
    cpattn plan --model qwen3-235b-a22b --input-len 32768 --output-len 1024 --objective throughput
    cpattn plan --model deepseek-r1 --input-len 8192 --output-len 512 --objective goodput --ttft-slo 2s --tpot-slo 50ms
    cpattn plan --model deepseek-r1 --input-len 8192 --objective goodput --ttft-slo 2s --request-rate 2  # Poisson
    cpattn plan --model deepseek-r1 --input-len 32768 --concurrency 16   # per-request TTFT p50 / p99, makespan
    cpattn plan --model qwen3-235b-a22b --layout tp=8,dcp=4              # refused: rule and fix, exit 2
    cpattn plan --model glm-5 --input-len 131072 --devices 8             # fits False: the term and the fix
    cpattn plan --model deepseek-r1 --pd tp=1,pcp=8/tp=8,dcp=8 --compute-dtype fp8 --dp-attention
    cpattn plan calibrate [--quick] [--out PATH] [--force]    # fit the CPU profile on this machine
    cpattn plan validate --pcp-json p.json --dcp-json d.json --graph-json g.json
    cpattn plan anchors                                       # the published anchors, predicted

Objectives: ttft (lowest p99 per-request TTFT), tpot (lowest time per output
token), throughput (most tokens/s per device at the concurrency memory
holds), goodput (most tokens/s per device at the largest concurrency that
meets --ttft-slo / --tpot-slo, one of them required; with --request-rate R
requests arrive as a Poisson process at R/s instead of one burst, TTFT an
M/D/1 queue on the prefill, goodput the largest rate meeting the SLOs). Layouts within
--tie-tolerance of the best are reported as a tie, broken by the next
metric. SLOs given with any objective also filter the layouts.

Layouts: every tp * pcp = --devices (dcp a divisor) goes through the
engine's own rule check (EngineConfig.create); refused ones are listed with
their rule and fix, never priced. A layout that does not fit names the
memory term that overflows (weights, activations, KV) and the smallest
change that fits. Models: a built-in name (deepseek-v3.2, deepseek-r1,
glm-5, qwen3-235b-a22b, kimi-k2, llama3-405b, deepseek-v4-flash) or a Hugging Face config.json. Profiles:
h200, b200, ascend-910c, cpu (the calibrated one once ``cpattn plan
calibrate`` saved it), or a profile JSON. Every assumption is printed.
"""

from __future__ import annotations

from cpattn.config import cli_args as cli
from cpattn.config.cli_output import table, write_json
from cpattn.plan.rules import fix_of, rule_of

SUBCOMMANDS = ("calibrate", "validate", "anchors")  # cpattn.cli sends these to cpattn.bench.perf.cli


def main(argv: list[str] | None = None) -> int:
    """Run ``cpattn plan ARGV``; return the exit status (0 ok, 2 usage error). ``calibrate`` / ``validate``
    / ``anchors`` are benchmark-side (:func:`cpattn.bench.perf.cli.main`, which ``cpattn plan SUB`` runs);
    passing them here still works, deprecated (:mod:`cpattn.plan._experiments_moved`)."""
    argv = list(argv or [])
    if argv and argv[0] in SUBCOMMANDS:
        from cpattn.plan import _experiments_moved

        return _experiments_moved.run(argv)
    return _plan(argv)


# ----------------------------------------------------------------------------- cpattn plan
def _plan_parser():
    from cpattn.dcp.layer_merges import cli_merge
    from cpattn.plan.model import DCP_MERGES, PCP_METHODS
    from cpattn.plan.objective import OBJECTIVES

    p = cli.parser("cpattn plan", __doc__)
    p.add_argument("--model", default="deepseek-v3.2", help="built-in model name or a Hugging Face config.json")
    p.add_argument("--input-len", "--context", dest="context", type=cli.positive_int, default=65536, metavar="N",
                   help="prompt tokens per request (the decode's cached context)")
    p.add_argument("--concurrency", "--batch", dest="batch", type=cli.positive_int, default=1, metavar="C",
                   help="requests in flight (arriving together: prefilled first come first served, decoded together)")
    p.add_argument("--devices", type=cli.positive_int, default=8, help="devices of one engine (tp * pcp)")
    p.add_argument("--profile", default="h200", help="h200, b200, ascend-910c, cpu or a profile JSON")
    p.add_argument("--output-len", type=cli.positive_int, default=1024,
                   help="generated tokens per request (KV sizing, goodput)")
    p.add_argument("--objective", choices=OBJECTIVES, default="ttft", help="what the recommendation optimises")
    p.add_argument("--ttft-slo", type=duration, default=None, metavar="T",
                   help="p99 TTFT bound, e.g. 2s or 500ms, for goodput and as a filter on every objective; default: none")
    p.add_argument("--tpot-slo", type=duration, default=None, metavar="T",
                   help="TPOT bound, e.g. 50ms, for goodput and as a filter on every objective; default: none")
    p.add_argument("--request-rate", type=cli.positive_float, default=None, metavar="R",
                   help="with --objective goodput: requests arrive as a Poisson process at R requests/s (TTFT an "
                        "M/D/1 queue on the prefill; goodput the largest rate meeting the SLOs); default: one burst "
                        "of --concurrency requests")
    p.add_argument("--tie-tolerance", type=fraction, default=0.02,
                   help="layouts this close (relative) to the best are a tie, broken by the next metric")
    p.add_argument("--weights", default=None, help="weight dtype override: bf16, fp8, w8a8, int4, nvfp4")
    p.add_argument("--kv-cache-dtype", default=None, help="KV dtype override: bf16 or fp8")
    p.add_argument("--max-batched-tokens", type=cli.positive_int, default=8192,
                   help="tokens one prefill step holds activations for (vLLM's --max-num-batched-tokens)")
    p.add_argument("--pcp-method", choices=PCP_METHODS, default="ring", help="PCP KV exchange")
    p.add_argument("--dcp-merge", type=cli_merge, choices=DCP_MERGES, default="local_a2a",
                   help="DCP decode-layer variant (cpattn.dcp.layer_merges; 'fold' is local_fold's old name)")
    p.add_argument("--layout", action="append", type=layout_arg, default=None, metavar="tp=T[,pcp=P][,dcp=D]",
                   help="price only these layouts (repeatable; each checked by the engine's rules, a refused one "
                        "is reported with its rule and fix); default: every tp * pcp = --devices, dcp a divisor")
    p.add_argument("--allow-pcp-with-dcp", action="store_true",
                   help="the engine's opt-in to PCP and DCP in one engine (refused without it)")
    p.add_argument("--pd", action="append", type=pd_arg, default=None, metavar="PREFILL/DECODE",
                   help="also price a P/D split, e.g. tp=1,pcp=8/tp=8,dcp=8: a prefill engine, a decode engine "
                        "and the KV moved between them, repeatable, both sides through the engine's P/D rules; "
                        "default: none")
    p.add_argument("--dp-attention", action="store_true",
                   help="also price data-parallel attention: dp replicas of tp * pcp devices sharing one expert "
                        "group (vLLM's --data-parallel-size with --enable-expert-parallel)")
    p.add_argument("--compute-dtype", default="bf16",
                   help="the peak FLOP/s every op runs at: a dtype of the profile (h200: bf16, fp8; ascend-910c: "
                        "bf16, int8)")
    cli.add_json(p)
    return p


def _plan(argv) -> int:
    from cpattn.plan.fits import fit_changes
    from cpattn.plan.model import Options, predict
    from cpattn.plan.objective import SLO, _slo, rank, recommend, with_goodput
    from cpattn.plan.specs import WEIGHT_BYTES, get_model

    ap = _plan_parser()
    a = ap.parse_args(argv)
    for flag, v in (("--weights", a.weights), ("--kv-cache-dtype", a.kv_cache_dtype)):
        if v is not None and v not in WEIGHT_BYTES:
            cli.bad_value(ap.prog, flag, repr(v), f"one of {', '.join(WEIGHT_BYTES)}", "pick a listed dtype")
    try:
        spec = get_model(a.model, weights=a.weights, kv_dtype=a.kv_cache_dtype)
    except (ValueError, OSError) as e:  # JSONDecodeError is a ValueError
        cli.usage_error(ap.prog, f"argument --model: {e}")
    except (KeyError, TypeError) as e:
        cli.usage_error(ap.prog, f"argument --model: saw {a.model!r}; rule: a Hugging Face config.json with the "
                                 f"model's shapes (it lacks or mistypes {e}); fix: pass the model's own config.json")
    prof = _profile(ap.prog, a.profile)
    if a.compute_dtype not in prof.flops:
        cli.bad_value(ap.prog, "--compute-dtype", repr(a.compute_dtype), f"a dtype {prof.name} has a peak for",
                      f"use one of {', '.join(prof.flops)}")
    opts = Options(pcp_method=a.pcp_method, dcp_merge=a.dcp_merge, output=a.output_len,
                   compute_dtype=a.compute_dtype, allow_pcp_with_dcp=a.allow_pcp_with_dcp,
                   max_batched_tokens=a.max_batched_tokens)
    slo = SLO(a.ttft_slo, a.tpot_slo)
    if a.objective == "goodput" and not slo:
        cli.bad_value(ap.prog, "--objective", "'goodput' without an SLO", "goodput counts what meets an SLO",
                      "add --ttft-slo T and/or --tpot-slo T (e.g. --ttft-slo 2s --tpot-slo 50ms)")
    if a.request_rate is not None and a.objective != "goodput":
        cli.bad_value(ap.prog, "--request-rate", f"{a.request_rate:g} with --objective {a.objective}",
                      "the arrival rate prices goodput", "add --objective goodput (with --ttft-slo / --tpot-slo)")
    lays, refused = _layouts(ap.prog, spec, a, opts)
    pd, pd_refused = _pd(ap.prog, spec, prof, a, opts)
    preds = [predict(spec, prof, lay, context=a.context, batch=a.batch, opts=opts) for lay in lays]
    if a.objective == "goodput":
        preds = with_goodput(preds, spec, prof, context=a.context, slo=slo, opts=opts, request_rate=a.request_rate)
    ranked = rank(preds, a.objective, a.tie_tolerance, slo)
    best, why = recommend(preds, a.objective, a.tie_tolerance, slo=slo)
    devices = a.devices if not a.layout else lays[0].devices
    changes = [] if any(p.fits for p in preds) else fit_changes(spec, prof, devices, a.context, a.batch, opts)
    if changes:
        why += "; smallest change that fits: " + "; or ".join(
            f"{c['change']} ({', '.join(c['layouts'][:3])}{' ...' if len(c['layouts']) > 3 else ''})" for c in changes)
    rows = [_row(p, a, slo) for p in preds]
    from cpattn.plan.breakeven import pcp_break_even

    even = {str(p.layout): pcp_break_even(spec, p.layout, prof, opts=opts) for p in preds
            if p.layout.pcp > 1 and p.layout.dcp == 1}
    with cli.report_to(a.json):
        print(f"{spec.name} ({spec.attention}, {spec.total_params() / 1e9:.0f}B params, {spec.weights} weights, "
              f"{spec.kv_dtype} KV) on {devices} x {prof.device}; input {a.context}, output {a.output_len} tokens, "
              f"concurrency {a.batch}; objective {a.objective}"
              + (f", SLO TTFT p99 <= {_slo(slo.ttft_s)}, TPOT <= {_slo(slo.tpot_s)}" if slo else "")
              + f"; {a.compute_dtype} compute; PCP {a.pcp_method}, DCP {a.dcp_merge}")
        print(table(rows, list(rows[0])))
        if pd or pd_refused:
            print("\nP/D splits (TTFT: the prefill engine's plus moving the request's KV between nodes; TPOT and "
                  "tok/s: the decode engine's, per device of both):")
        if pd:
            print(table([{"prefill / decode": f"{r['prefill']} / {r['decode']}", "devices": r["devices"],
                          "TTFT_p50_ms": 1e3 * r["ttft_p50_s"], "TTFT_p99_ms": 1e3 * r["ttft_p99_s"],
                          "KV_transfer_ms": 1e3 * r["transfer_s"], "TPOT_ms": 1e3 * r["tpot_s"], "fits": r["fits"],
                          "tok_s_per_device": r["tokens_per_s_per_device"]} for r in pd],
                        ["prefill / decode", "devices", "TTFT_p50_ms", "TTFT_p99_ms", "KV_transfer_ms", "TPOT_ms",
                         "fits", "tok_s_per_device"]))
        for r in pd_refused:
            print(f"  - refused: {r['prefill']} / {r['decode']}: " + " -- also ".join(r["problems"]))
        if a.request_rate is not None:
            print(f"\nrate_*: requests arriving as a Poisson process at {a.request_rate:g}/s (TTFT: an M/D/1 queue "
                  "on one request's prefill per DP replica, plan.arrival; rho: the prefill's load; TPOT at Little's "
                  "concurrency); max_rate_req_s: the largest rate meeting the SLOs, goodput its output tokens/s "
                  "per device")
        if a.batch > 1:
            print(f"\nTTFT p50 / p99: per request, {a.batch} arriving together, prefilled first come first served "
                  f"({a.max_batched_tokens} tokens a step); makespan: the whole batch's prefill")
        if not a.layout and not a.allow_pcp_with_dcp and a.devices > 1:
            print("\n(PCP with DCP in one engine is refused by the guide's rule, so those layouts are not listed; "
                  "--allow-pcp-with-dcp prices them)")
        if refused:
            print("\nrefused by the engine's rules (EngineConfig.create), not priced:")
            for r in refused:
                print(f"  - {r.layout}: " + " -- also ".join(
                    f"{p.split(':', 1)[0]}: {rule_of(p)}; fix: {fix_of(p)}" for p in r.problems))
        if even:
            print("\nPCP break-even (one request's TTFT is lower with the layout's PCP than on one of its PCP "
                  "ranks from this prompt length on, plan.pcp_break_even): " + "; ".join(
                      f"{k}: {'never' if v is None else f'{v} tokens'}" for k, v in even.items()))
        print(f"\nrecommendation: {why}")
        print("\nassumptions:")
        for line in _assumptions(spec, prof):
            print(f"  - {line}")
    write_json(a.json, {"model": spec.name, "profile": prof.name, "context": a.context, "batch": a.batch,
                        "input_len": a.context, "output_len": a.output_len, "concurrency": a.batch,
                        "devices": devices, "objective": a.objective,
                        "slo": {"ttft_s": a.ttft_slo, "tpot_s": a.tpot_slo}, "request_rate": a.request_rate,
                        "predictions": [{**p.as_dict(), "makespan_s": p.makespan_s} for p in preds],
                        "refused": [r.as_dict() for r in refused],
                        "recommendation": None if best is None else str(best.layout), "reason": why,
                        "ties": [str(p.layout) for p in ranked["ties"]],
                        "per_objective": {o: str(p.layout) for o, p in ranked["per_objective"].items()},
                        "fit_changes": changes, "pcp_break_even": even, "pd": pd, "pd_refused": pd_refused,
                        "assumptions": _assumptions(spec, prof)})
    return 0


def _row(p, a, slo) -> dict:
    row = {"layout": str(p.layout), "TTFT_p50_ms": 1e3 * p.ttft_p50_s, "TTFT_p99_ms": 1e3 * p.ttft_p99_s,
           "makespan_ms": 1e3 * p.makespan_s, "TPOT_ms": 1e3 * p.tpot_s, "weights_GB": p.weights_bytes / 1e9,
           "KV_GB_per_device": p.kv_bytes / 1e9, "KV_B_per_token": p.kv_bytes_per_token,
           "max_requests": p.max_requests, "fits": p.fits,
           "overflow": "-" if p.fits else f"{p.overflow} +{p.memory['short'] / 1e9:.1f} GB",
           "tok_s_per_device": p.tokens_per_s_per_device}
    if slo:
        row["meets_slo"] = slo.met(p.ttft_p99_s, p.tpot_s)
    g = p.parts.get("goodput")
    if g and g.get("arrival") == "poisson":  # the burst's SLO check does not apply: the arrival model's does
        at = g["at"]
        row.pop("meets_slo", None)
        row.update({"rate_TTFT_p50_ms": 1e3 * at["ttft_p50_s"], "rate_TTFT_p99_ms": 1e3 * at["ttft_p99_s"],
                    "rate_TPOT_ms": 1e3 * at["tpot_s"], "rate_rho": at["rho"], "meets_slo_at_rate": g["meets_at_rate"],
                    "max_rate_req_s": g["max_rate"], "goodput_tok_s_per_device": g["tokens_per_s_per_device"]})
    elif g:
        row["goodput_requests"] = g["concurrency"]
        row["goodput_tok_s_per_device"] = g["tokens_per_s_per_device"]
    return row


def duration(text: str) -> float:
    """``--ttft-slo 2s`` / ``500ms`` / ``0.05`` (seconds) -> seconds."""
    import argparse

    t = text.strip().lower()
    scale = 1e-3 if t.endswith("ms") else 1.0
    t = t[:-2] if t.endswith("ms") else t[:-1] if t.endswith("s") else t
    try:
        v = float(t) * scale
    except ValueError:
        v = -1.0
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a positive duration; fix: e.g. 2s, 500ms or 0.05")
    return v


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    import argparse

    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: a fraction in [0, 1); fix: e.g. 0.02 (2%)")
    return v


def pd_arg(text: str):
    """``--pd tp=1,pcp=8/tp=8,dcp=8`` -> (prefill Layout, decode Layout)."""
    import argparse

    sides = text.split("/")
    if len(sides) != 2:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: PREFILL/DECODE, two layouts; "
                                         "fix: e.g. --pd tp=1,pcp=8/tp=8,dcp=8")
    return layout_arg(sides[0]), layout_arg(sides[1])


def _pd(prog, spec, prof, a, opts) -> tuple[list[dict], list[dict]]:
    """(priced P/D splits, refused ones) of ``--pd``; a usage error when every one is refused."""
    from cpattn.plan.pd import pd_problems, predict_pd

    done, refused = [], []
    for pre, dec in dict.fromkeys(a.pd or []):
        found = pd_problems(spec, pre, dec, opts.allow_pcp_with_dcp)
        if found:
            refused.append({"prefill": str(pre), "decode": str(dec), "problems": found})
            continue
        r = predict_pd(spec, prof, pre, dec, context=a.context, batch=a.batch, opts=opts)
        done.append({"prefill": str(pre), "decode": str(dec), "devices": r["devices"],
                     "ttft_p50_s": r["ttft_p50_s"], "ttft_p99_s": r["ttft_p99_s"], "transfer_s": r["transfer_s"],
                     "tpot_s": r["tpot_s"], "fits": r["fits"], "tokens_per_s_per_device": r["tokens_per_s_per_device"]})
    if a.pd and not done:
        cli.usage_error(prog, "argument --pd: " + " -- also ".join(
            f"{r['prefill']} / {r['decode']} for {spec.name}: {'; '.join(r['problems'])}" for r in refused))
    return done, refused


def layout_arg(text: str):
    """``--layout tp=8,dcp=2`` (also ``pcp=``, ``dp=``; omitted sizes are 1) -> a :class:`Layout`."""
    import argparse

    from cpattn.plan.model import Layout

    sizes = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        key, sep, val = part.partition("=")
        if not sep or key not in ("tp", "pcp", "dcp", "dp") or not val.isdigit() or int(val) < 1 or key in sizes:
            raise argparse.ArgumentTypeError(f"saw {text!r}; rule: comma-separated tp=, pcp=, dcp=, dp= sizes, "
                                             "each a positive int, tp required; fix: e.g. --layout tp=8,dcp=2")
        sizes[key] = int(val)
    if "tp" not in sizes:
        raise argparse.ArgumentTypeError(f"saw {text!r}; rule: tp= is required; fix: e.g. --layout tp=8,dcp=2")
    return Layout(**sizes)


def _layouts(prog, spec, a, opts):
    """(accepted, refused) layouts: those of ``--layout``, or the space of ``--devices``; a usage error when
    none is accepted (one line: the rules and the fixes)."""
    from cpattn.plan.rules import Refusal, layout_problems, layout_space

    if a.layout:
        found = [(lay, layout_problems(spec, lay, opts.allow_pcp_with_dcp)) for lay in dict.fromkeys(a.layout)]
        ok, refused = [lay for lay, f in found if not f], [Refusal(lay, tuple(f)) for lay, f in found if f]
        if not ok:
            cli.usage_error(prog, "argument --layout: " + " -- also ".join(
                f"{r.layout} for {spec.name}: {'; '.join(r.problems)}" for r in refused))
        return ok, refused
    ok, refused = layout_space(spec, a.devices, opts.allow_pcp_with_dcp, a.dp_attention)
    if not ok:
        cli.bad_value(prog, "--devices", a.devices, f"a device count some (tp, pcp, dcp) of {spec.name} accepts "
                      f"({spec.heads} heads must split over tp)", "use a divisor or multiple of the head count")
    return ok, refused


def _profile(prog: str, name: str):
    """:func:`cpattn.plan.profiles.get_profile`, or a usage error naming ``--profile`` (one line, exit 2)."""
    from cpattn.plan.profiles import get_profile

    try:
        return get_profile(name)
    except (ValueError, OSError) as e:  # JSONDecodeError is a ValueError
        cli.usage_error(prog, f"argument --profile: saw {name!r}: {e}")
    except (KeyError, TypeError) as e:
        cli.usage_error(prog, f"argument --profile: saw {name!r}; rule: a profile JSON as cpattn plan calibrate "
                              f"writes it (it lacks or mistypes {e}); fix: pass h200, b200, ascend-910c, cpu or such a file")


def _assumptions(spec, prof) -> list[str]:
    from cpattn.plan.model import KERNELS_PER_LAYER

    src = prof.sources
    return [
        f"model shapes: {spec.source or 'config.json'}",
        *(f"{prof.name} {k}: {v}" for k, v in src.items()),
        "attention, dense and shared-expert weights over TP; routed experts over all tp * pcp devices (expert "
        "parallel, token rows split over TP for dispatch); uniform routing",
        f"{KERNELS_PER_LAYER['prefill']} eager kernels per prefill layer; {KERNELS_PER_LAYER['decode']} kernels per "
        "decode layer at the in-graph launch cost",
        "decode with pcp > 1: every PCP rank runs the step, KV sharded over pcp * dcp, one more all-gather over PCP",
        "KV capacity: mem_util of device memory, less a 5% reserve, the weights and one prefill step's "
        "activations (an estimate: residual + the wider of the attention and MLP blocks, bf16)",
    ]


