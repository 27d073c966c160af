"""The report of ``cpattn bench serve``: its table, the summary that sets elastic CP beside the static
layouts (the serving comparisons its docs state), and the latency-vs-rate plot.

>>> _median([3.0, None, 1.0, 2.0]), _ratio(1.0, 0), _ms(123.4)
(2.0, None, '123')
"""

from __future__ import annotations

import math

from cpattn.bench import harness


def _ms(v) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def _num(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _progress_line(r: dict) -> str:
    return (f"  {r['workload']:<6} rate {r['rate']}  {r['layout']:<17} TTFT p50 {_ms(r['ttft_ms']['p50'])} ms  "
            f"TPOT p50 {_ms(r['tpot_ms']['p50'])} ms  {r['completed']}/{r['requests']} ok")


def table(payload: dict) -> str:
    """The results as one text table (ms; rates per second)."""
    head = ["workload", "rate", "layout", "TTFT p50/p90/p99", "TPOT p50/p90/p99", "ITL p50/p90/p99", "req/s",
            "out tok/s", "goodput", "hit %", "replayed/eager", "pcp", "ok"]
    rows = []
    for r in payload["results"]:
        trio = lambda d: "/".join(_ms(d[f"p{p}"]) for p in (50, 90, 99))  # noqa: E731
        hit = r["prefix_hit_rate"]
        cells = (r["workload"], str(r["rate"]), r["layout"], trio(r["ttft_ms"]), trio(r["tpot_ms"]),
                 trio(r["itl_ms"]), _num(r["request_throughput_rps"]), _num(r["output_tokens_per_s"], "{:.1f}"),
                 _num(r["goodput_rps"]), "-" if hit is None else f"{100 * hit:.0f}",
                 f"{r['replayed_steps']}/{r['eager_steps']}", str(r.get("pcp_steps", "-")),
                 f"{r['completed']}/{r['requests']}")
        rows.append(dict(zip(head, cells)))  # cells as text: the harness's table prints them as they are
    lines = [harness.table(rows, head)]
    s = payload["settings"]
    lines.append(f"latencies in ms; goodput = requests/s with TTFT <= {s['slo_ttft_ms']:g} ms and TPOT <= "
                 f"{s['slo_tpot_ms']:g} ms; hit % = prefix-cache hit tokens / looked-up tokens over the run; "
                 "replayed/eager = engine steps over the run (dp2: both servers); pcp = steps with a PCP prefill chunk "
                 "(pd-2-2: its prefill role)")
    return "\n".join(lines)


def _kind_p50(r: dict, kind: str):
    return ((r.get("by_kind") or {}).get(kind) or {}).get("ttft_ms", {}).get("p50")


def _ratio(a, b):
    """``a / b`` (:func:`cpattn.bench.harness.safe_div`: never a division by 0), None where either is missing
    or ``b`` is not positive."""
    if a is None or b is None:
        return None
    r = harness.safe_div(a, b)
    return None if math.isnan(r) else r


def _median(xs: list) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def summary(payload: dict) -> dict:
    """The goal comparisons of one run, as docs/serve.md states them (None where a layout or class is
    missing; nothing divides by 0).

    ``mixed``: per rate, per layout, short / long TTFT p50 (ms) and goodput (req/s); ``elastic_short_vs_dp2``
    / ``elastic_long_vs_pcp2`` / ``elastic_goodput_vs_best_static``: per rate and their median over rates;
    ``long_pcp2_vs_dp2_lowest_rate``; ``captured_tpot_vs_eager``: dcp2-graph / dcp2 TPOT p50 per workload
    and rate (``captured_le_eager``: every one <= 1).

    >>> row = lambda lay, s, l, g: {"workload": "mixed", "rate": 1.0, "layout": lay, "goodput_rps": g,
    ...     "tpot_ms": {"p50": 10.0}, "by_kind": {"short": {"ttft_ms": {"p50": s}}, "long": {"ttft_ms": {"p50": l}}}}
    >>> s = summary({"results": [row("dp2", 100.0, 1000.0, 1.0), row("pcp2-dcp2", 120.0, 500.0, 0.8),
    ...                          row("pcp2-dcp2-elastic", 105.0, 520.0, 1.0)]})
    >>> s["elastic_short_vs_dp2"]["median"], s["elastic_long_vs_pcp2"]["median"], s["long_pcp2_vs_dp2_lowest_rate"]
    (1.05, 1.04, 0.5)
    """
    res = payload["results"]
    mixed = [r for r in res if r["workload"] == "mixed"]
    rates = sorted({r["rate"] for r in mixed}, key=lambda x: float(x))
    cell = {(r["rate"], r["layout"]): r for r in mixed}
    table_ = {str(rate): {lay: {"short_ttft_p50_ms": _kind_p50(r, "short"), "long_ttft_p50_ms": _kind_p50(r, "long"),
                                "goodput_rps": r.get("goodput_rps")}
                          for (rt, lay), r in cell.items() if rt == rate} for rate in rates}

    def per_rate(f) -> dict:
        vals = {str(rate): f(rate) for rate in rates}
        return {"per_rate": vals, "median": _median(list(vals.values()))}

    def get(rate, lay, key):
        return table_[str(rate)].get(lay, {}).get(key)

    static = [lay for lay in ("dp2", "dcp2", "dcp2-graph", "pcp2-dcp2", "pd-2-2")]

    def best_static(rate):
        gs = [g for lay in static if (g := get(rate, lay, "goodput_rps")) is not None]
        return max(gs) if gs else None

    el = "pcp2-dcp2-elastic"
    out = {"mixed": table_,
           "elastic_short_vs_dp2": per_rate(lambda r: _ratio(get(r, el, "short_ttft_p50_ms"),
                                                              get(r, "dp2", "short_ttft_p50_ms"))),
           "elastic_long_vs_pcp2": per_rate(lambda r: _ratio(get(r, el, "long_ttft_p50_ms"),
                                                             get(r, "pcp2-dcp2", "long_ttft_p50_ms"))),
           "elastic_goodput_vs_best_static": per_rate(lambda r: _ratio(get(r, el, "goodput_rps"), best_static(r))),
           "long_pcp2_vs_dp2_lowest_rate": _ratio(get(rates[0], "pcp2-dcp2", "long_ttft_p50_ms"),
                                                  get(rates[0], "dp2", "long_ttft_p50_ms")) if rates else None}
    cap = {}
    for w in sorted({r["workload"] for r in res}):
        by = {(r["rate"], r["layout"]): r for r in res if r["workload"] == w}
        for rate in sorted({r["rate"] for r in res if r["workload"] == w}, key=lambda x: float(x)):
            g, e = by.get((rate, "dcp2-graph")), by.get((rate, "dcp2"))
            if g and e:
                cap[f"{w}@{rate}"] = _ratio(g["tpot_ms"]["p50"], e["tpot_ms"]["p50"])
    out["captured_tpot_vs_eager"] = cap
    out["captured_le_eager"] = None if not cap or None in cap.values() else all(v <= 1 for v in cap.values())
    return out


def summary_lines(sm: dict) -> list[str]:
    """The summary as text (one line per rate and comparison)."""
    def x(v) -> str:
        return "-" if v is None else f"{v:.2f}x"

    lines = ["summary (mixed workload; TTFT p50 ms short / long by prompt class, goodput req/s):"]
    for rate, lays in sm["mixed"].items():
        cells = [f"{lay} {_ms(c['short_ttft_p50_ms'])}/{_ms(c['long_ttft_p50_ms'])} gp {_num(c['goodput_rps'])}"
                 for lay, c in lays.items()]
        lines.append(f"  rate {rate}: " + "; ".join(cells))
    for key, what, goal in (("elastic_short_vs_dp2", "elastic / dp2 short-request TTFT p50", "<= 1.10x"),
                            ("elastic_long_vs_pcp2", "elastic / pcp2-dcp2 long-request TTFT p50", "<= 1.10x"),
                            ("elastic_goodput_vs_best_static", "elastic / best static goodput", ">= 1.00x")):
        d = sm[key]
        per = ", ".join(f"{r}: {x(v)}" for r, v in d["per_rate"].items())
        lines.append(f"  {what}: median {x(d['median'])} (goal {goal}; per rate {per})")
    lines.append(f"  long-request TTFT p50 PCP 2 / dp2 at the lowest rate: {x(sm['long_pcp2_vs_dp2_lowest_rate'])} "
                 "(goal <= 0.60x)")
    cap = ", ".join(f"{k}: {x(v)}" for k, v in sm["captured_tpot_vs_eager"].items()) or "-"
    ok = {True: "yes", False: "no", None: "-"}[sm["captured_le_eager"]]
    lines.append(f"  captured TPOT <= eager (dcp2-graph / dcp2 TPOT p50) at every rate: {ok} ({cap})")
    lines.append("  each cell is one interleaved run on a shared, noisy machine: ranks are approximate")
    return lines


def plot(payload: dict, path: str) -> str | None:
    """Latency-vs-rate curves per layout (one column per workload: TTFT p50 / p99, TPOT p50); None when
    written, else why not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); pip install matplotlib for --plot"
    res, s = payload["results"], payload["settings"]
    panels = [("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50")]
    fig, axes = plt.subplots(len(panels), len(s["workloads"]), figsize=(5 * len(s["workloads"]), 3.2 * len(panels)),
                             squeeze=False)
    for j, w in enumerate(s["workloads"]):
        for i, (metric, p) in enumerate(panels):
            ax = axes[i][j]
            for name in s["layouts"]:
                pts = [(r["rate"], r[metric][p]) for r in res if r["workload"] == w and r["layout"] == name
                       and r[metric][p] is not None and r["rate"] != "inf"]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=name)
            ax.set_title(f"{w}: {metric.split('_')[0].upper()} {p}")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("ms")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
