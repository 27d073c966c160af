"""``cpattn plan``: predict TTFT, TPOT, KV bytes and concurrency per (tp, pcp, dcp) on hardware we do not have.

Usage::

    cpattn plan --model deepseek-v3.2 --context 65536 --batch 4 --devices 8 --profile h200
    cpattn plan --model path/to/config.json --profile ascend-910c --devices 16 --json -
    cpattn plan calibrate [--quick] [--out PATH]    # fit the CPU profile on this machine
    cpattn plan validate --pcp-json p.json --dcp-json d.json --graph-json g.json
    cpattn plan anchors                             # the published anchors, predicted

Models: a built-in name (deepseek-v3.2, deepseek-r1, glm-5, qwen3-235b-a22b,
kimi-k2) or a Hugging Face config.json. Profiles: h200, b200, ascend-910c,
cpu (the calibrated one once ``cpattn plan calibrate`` saved it), or a
profile JSON. Every layout ``EngineConfig.create`` accepts for the model and
device count is predicted; the recommendation names its reason. Every
assumption the numbers rest on is printed.
"""

from __future__ import annotations

from cpattn.bench import args as cli
from cpattn.bench.common import table, write_json
from cpattn.plan.rules import fix_of, rule_of

SUBCOMMANDS = ("calibrate", "validate", "anchors")


def main(argv: list[str] | None = None) -> int:
    """Run ``cpattn plan ARGV``; return the exit status (0 ok, 2 usage error)."""
    argv = list(argv or [])
    if argv and argv[0] in SUBCOMMANDS:
        from cpattn.plan import cli_tools

        return getattr(cli_tools, f"_{argv[0]}")(argv[1:])
    return _plan(argv)


# ----------------------------------------------------------------------------- cpattn plan
def _plan_parser():
    from cpattn.plan.model import DCP_MERGES, PCP_METHODS

    p = cli.parser("cpattn plan", __doc__)
    p.add_argument("--model", default="deepseek-v3.2", help="built-in model name or a Hugging Face config.json")
    p.add_argument("--context", type=cli.positive_int, default=65536, help="prompt / cached tokens per request")
    p.add_argument("--batch", type=cli.positive_int, default=1, help="requests (prefilled together; decoded together)")
    p.add_argument("--devices", type=cli.positive_int, default=8, help="devices of one engine (tp * pcp)")
    p.add_argument("--profile", default="h200", help="h200, b200, ascend-910c, cpu or a profile JSON")
    p.add_argument("--output-len", type=cli.positive_int, default=1024, help="generated tokens per request (KV sizing)")
    p.add_argument("--weights", default=None, help="weight dtype override: bf16, fp8, w8a8, int4, nvfp4")
    p.add_argument("--kv-cache-dtype", default=None, help="KV dtype override: bf16 or fp8")
    p.add_argument("--max-batched-tokens", type=cli.positive_int, default=8192,
                   help="tokens one prefill step holds activations for (vLLM's --max-num-batched-tokens)")
    p.add_argument("--pcp-method", choices=PCP_METHODS, default="ring", help="PCP KV exchange")
    p.add_argument("--dcp-merge", choices=DCP_MERGES, default="local_a2a", help="DCP decode-layer variant")
    p.add_argument("--layout", action="append", type=layout_arg, default=None, metavar="tp=T[,pcp=P][,dcp=D]",
                   help="price only these layouts (repeatable; each checked by the engine's rules, a refused one "
                        "is reported with its rule and fix); default: every tp * pcp = --devices, dcp a divisor")
    p.add_argument("--allow-pcp-with-dcp", action="store_true",
                   help="the engine's opt-in to PCP and DCP in one engine (refused without it)")
    cli.add_json(p)
    return p


def _plan(argv) -> int:
    from cpattn.plan.fits import fit_changes
    from cpattn.plan.model import Options, predict, recommend
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
    opts = Options(pcp_method=a.pcp_method, dcp_merge=a.dcp_merge, output=a.output_len,
                   allow_pcp_with_dcp=a.allow_pcp_with_dcp, max_batched_tokens=a.max_batched_tokens)
    lays, refused = _layouts(ap.prog, spec, a, opts)
    preds = [predict(spec, prof, lay, context=a.context, batch=a.batch, opts=opts) for lay in lays]
    best, why = recommend(preds)
    changes = [] if best is not None else fit_changes(spec, prof, a.devices, a.context, a.batch, opts)
    if changes:
        why += "; smallest change that fits: " + "; or ".join(
            f"{c['change']} ({', '.join(c['layouts'][:3])}{' ...' if len(c['layouts']) > 3 else ''})" for c in changes)
    rows = [{"layout": str(p.layout), "TTFT_ms": 1e3 * p.ttft_s, "TPOT_ms": 1e3 * p.tpot_s,
             "weights_GB": p.weights_bytes / 1e9, "KV_GB_per_device": p.kv_bytes / 1e9,
             "KV_B_per_token": p.kv_bytes_per_token, "max_requests": p.max_requests, "fits": p.fits,
             "overflow": "-" if p.fits else f"{p.overflow} +{p.memory['short'] / 1e9:.1f} GB",
             "tok_s_per_device": p.tokens_per_s_per_device} for p in preds]
    with cli.report_to(a.json):
        print(f"{spec.name} ({spec.attention}, {spec.total_params() / 1e9:.0f}B params, {spec.weights} weights, "
              f"{spec.kv_dtype} KV) on {a.devices} x {prof.device}; context {a.context}, batch {a.batch}, "
              f"{a.output_len} output tokens; PCP {a.pcp_method}, DCP {a.dcp_merge}")
        print(table(rows, list(rows[0])))
        if not a.layout and not a.allow_pcp_with_dcp and a.devices > 1:
            print("\n(PCP with DCP in one engine is refused by the guide's rule, so those layouts are not listed; "
                  "--allow-pcp-with-dcp prices them)")
        if refused:
            print("\nrefused by the engine's rules (EngineConfig.create), not priced:")
            for r in refused:
                print(f"  - {r.layout}: " + " -- also ".join(
                    f"{p.split(':', 1)[0]}: {rule_of(p)}; fix: {fix_of(p)}" for p in r.problems))
        print(f"\nrecommendation: {why}")
        print("\nassumptions:")
        for line in _assumptions(spec, prof):
            print(f"  - {line}")
    write_json(a.json, {"model": spec.name, "profile": prof.name, "context": a.context, "batch": a.batch,
                        "devices": a.devices, "predictions": [p.as_dict() for p in preds],
                        "refused": [r.as_dict() for r in refused],
                        "recommendation": None if best is None else str(best.layout), "reason": why,
                        "fit_changes": changes,
                        "assumptions": _assumptions(spec, prof)})
    return 0


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
    ok, refused = layout_space(spec, a.devices, opts.allow_pcp_with_dcp)
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


