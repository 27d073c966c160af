"""``cpattn bench serve``: the load generator's schedule and statistics, and one end-to-end quick run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from cpattn.bench.serve import LAYOUTS, _delta, parse_metrics, summary, summary_lines
from cpattn.bench.serve_load import (Record, fixed_workload, mixed_workload, percentile, poisson_arrivals,
                                     summarize)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_poisson_schedule_is_seeded_and_has_the_rate():
    """Gaps of a Poisson process at rate r are exponential(r): mean 1/r, standard deviation 1/r, and a gap
    exceeds its mean with probability 1/e. Each is checked within 4 standard errors on 4000 arrivals."""
    n, rate = 4000, 8.0
    t = poisson_arrivals(n, rate, seed=3)
    assert t == poisson_arrivals(n, rate, seed=3) and t != poisson_arrivals(n, rate, seed=4)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip(t, t[1:])]
    m = len(gaps)
    mean = sum(gaps) / m
    assert abs(mean - 1 / rate) < 4 * (1 / rate) / math.sqrt(m), mean
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (m - 1))
    assert abs(sd / mean - 1) < 4 * math.sqrt(2 / m), sd / mean  # CV 1; SE of an exponential's sd / mean ~ sqrt(2/m)
    over = sum(g > 1 / rate for g in gaps) / m
    p = math.exp(-1)
    assert abs(over - p) < 4 * math.sqrt(p * (1 - p) / m), over
    # counts in 1 s windows are Poisson(rate): their variance equals their mean (index of dispersion ~ 1)
    counts = [0] * int(t[-1])
    for x in t:
        if int(x) < len(counts):
            counts[int(x)] += 1
    cm = sum(counts) / len(counts)
    cv = sum((c - cm) ** 2 for c in counts) / (len(counts) - 1)
    assert abs(cm - rate) < 4 * math.sqrt(rate / len(counts)), cm
    assert 0.7 < cv / cm < 1.3, cv / cm
    assert poisson_arrivals(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0, 0)


def test_workloads_follow_their_stated_distributions():
    reqs = mixed_workload(2000, 1, 512, short=(64, 256), long=(2048, 4096), long_fraction=0.2, output=(16, 48))
    longs = [r for r in reqs if r.kind == "long"]
    frac = len(longs) / len(reqs)
    assert abs(frac - 0.2) < 4 * math.sqrt(0.2 * 0.8 / len(reqs)), frac
    assert all(2048 <= len(r.prompt) <= 4096 for r in longs)
    assert all(64 <= len(r.prompt) <= 256 for r in reqs if r.kind == "short")
    assert all(16 <= r.max_tokens <= 48 and all(0 <= t < 512 for t in r.prompt) for r in reqs)
    assert len({r.prompt[:64] for r in reqs}) == 1 and len({r.prompt[64:80] for r in reqs}) > 1900  # shared prefix only
    assert mixed_workload(5, 1, 512) == mixed_workload(5, 1, 512) != mixed_workload(5, 2, 512)
    assert {(len(r.prompt), r.max_tokens, r.kind) for r in fixed_workload(4, 0, 512)} == {(512, 32, "fixed")}


def test_percentiles_by_linear_interpolation():
    xs = [50.0, 10.0, 40.0, 20.0, 30.0]  # sorted: 10 20 30 40 50; rank (n-1) p / 100
    assert percentile(xs, 50) == 30.0
    assert percentile(xs, 90) == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10
    assert percentile(xs, 99) == pytest.approx(49.6)  # rank 3.96
    assert percentile(xs, 0) == 10.0 and percentile(xs, 100) == 50.0
    assert percentile([7.0], 90) == 7.0 and percentile([], 50) is None


def _records() -> list[Record]:
    return [Record("short", 100, ttft_s=0.1, e2e_s=1.1, n_out=11, itl_s=[0.1] * 10),  # TPOT 0.1
            Record("long", 3000, ttft_s=0.5, e2e_s=0.9, n_out=5, itl_s=[0.1] * 4),  # TPOT 0.1, TTFT misses 0.3
            Record("short", 120, ttft_s=0.2, e2e_s=0.2, n_out=1),  # one token: no TPOT
            Record("short", 80, error="APIConnectionError: refused"),
            Record("long", 2500, ttft_s=0.25, e2e_s=2.25, n_out=5, itl_s=[0.5] * 4)]  # TPOT 0.5 misses 0.15


def test_summary_arithmetic_against_hand_computed_values():
    s = summarize(_records(), duration_s=2.0, slo_ttft_s=0.3, slo_tpot_s=0.15)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["errors"] == ["APIConnectionError: refused"]
    # TTFT of the four completed: 0.1 0.2 0.25 0.5 s
    assert s["ttft_ms"]["p50"] == pytest.approx(225.0)  # rank 1.5
    assert s["ttft_ms"]["p90"] == pytest.approx(0.25e3 + 0.7 * 250)  # rank 2.7
    assert s["ttft_ms"]["mean"] == pytest.approx(262.5)
    # TPOT (e2e - ttft) / (n_out - 1) of the three with >= 2 tokens: 0.1 0.1 0.5
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0) and s["tpot_ms"]["p99"] == pytest.approx(100 + 0.98 * 400)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0) and s["itl_ms"]["p99"] == pytest.approx(500.0)
    assert s["output_tokens"] == 22 and s["input_tokens"] == 100 + 3000 + 120 + 2500
    assert s["request_throughput_rps"] == pytest.approx(2.0) and s["output_tokens_per_s"] == pytest.approx(11.0)
    assert s["good_requests"] == 2 and s["goodput_rps"] == pytest.approx(1.0)  # the first and the one-token one
    assert s["by_kind"]["long"]["requests"] == 2 and s["by_kind"]["long"]["ttft_ms"]["p50"] == pytest.approx(375.0)


def test_summary_never_divides_by_zero_or_crashes_on_nothing():
    s = summarize(_records(), duration_s=0.0, slo_ttft_s=1.0, slo_tpot_s=1.0)
    assert s["request_throughput_rps"] is None and s["goodput_rps"] is None and s["output_tokens_per_s"] is None
    e = summarize([], duration_s=None, slo_ttft_s=1.0, slo_tpot_s=1.0)
    assert e["ttft_ms"] == {"p50": None, "p90": None, "p99": None, "mean": None} and e["completed"] == 0
    failed = summarize([Record("x", 4, error="boom")], duration_s=1.0, slo_ttft_s=1.0, slo_tpot_s=1.0)
    assert failed["tpot_ms"]["p99"] is None and failed["goodput_rps"] == 0.0
    assert json.loads(json.dumps(e)) == e  # JSON-clean: None, not NaN


def test_metrics_deltas_give_hit_rate_and_step_counts():
    before = [parse_metrics("cpattn_prefix_hit_tokens_total 10\ncpattn_prefix_query_tokens_total 40\n"
                            "cpattn_replayed_steps_total 3\ncpattn_eager_steps_total 2\ncpattn_steps_total 5\n")]
    after = [parse_metrics("# HELP x\ncpattn_prefix_hit_tokens_total 40\ncpattn_prefix_query_tokens_total 140\n"
                           "cpattn_replayed_steps_total 13\ncpattn_eager_steps_total 6\ncpattn_steps_total 19\n")]
    d = _delta(before, after)
    assert d["prefix_hit_rate"] == pytest.approx(0.3) and (d["replayed_steps"], d["eager_steps"]) == (10, 4)
    assert _delta(before, before)["prefix_hit_rate"] is None  # nothing looked up: no rate, no ZeroDivisionError


def _row(workload, rate, layout, short, long, goodput, tpot=20.0):
    by = {k: {"requests": 1, "ttft_ms": {"p50": v, "p90": v, "p99": v, "mean": v}}
          for k, v in (("short", short), ("long", long)) if v is not None}
    return {"workload": workload, "rate": rate, "layout": layout, "goodput_rps": goodput,
            "tpot_ms": {"p50": tpot}, "by_kind": by}


def test_summary_compares_elastic_with_dp2_and_pcp2_per_rate_and_never_divides_by_zero():
    rows = [_row("mixed", 0.5, "dp2", 100.0, 1000.0, 0.5), _row("mixed", 0.5, "pcp2-dcp2", 130.0, 550.0, 0.4),
            _row("mixed", 0.5, "pcp2-dcp2-elastic", 104.0, 583.0, 0.5), _row("mixed", 0.5, "pd-2-2", 120.0, 500.0, 0.6),
            _row("mixed", 2.0, "dp2", 200.0, 2000.0, 1.0), _row("mixed", 2.0, "pcp2-dcp2", 260.0, 1000.0, 0.0),
            _row("mixed", 2.0, "pcp2-dcp2-elastic", 240.0, 1200.0, 1.5),
            _row("mixed", 2.0, "dcp2", 150.0, None, 0.0, tpot=30.0),  # no long request in this run
            _row("mixed", 2.0, "dcp2-graph", 150.0, None, 0.0, tpot=27.0),
            _row("fixed", 2.0, "dcp2", None, None, 0.0, tpot=30.0), _row("fixed", 2.0, "dcp2-graph", None, None, 0.0,
                                                                          tpot=33.0)]
    s = summary({"results": rows})
    assert s["elastic_short_vs_dp2"]["per_rate"] == {"0.5": pytest.approx(1.04), "2.0": pytest.approx(1.2)}
    assert s["elastic_short_vs_dp2"]["median"] == pytest.approx(1.12)  # median of two: their mean
    assert s["elastic_long_vs_pcp2"]["per_rate"] == {"0.5": pytest.approx(583 / 550), "2.0": pytest.approx(1.2)}
    assert s["elastic_goodput_vs_best_static"]["per_rate"] == {"0.5": pytest.approx(0.5 / 0.6),
                                                              "2.0": pytest.approx(1.5)}
    assert s["long_pcp2_vs_dp2_lowest_rate"] == pytest.approx(0.55)  # rate 0.5, not 2.0
    assert s["mixed"]["2.0"]["dcp2"] == {"short_ttft_p50_ms": 150.0, "long_ttft_p50_ms": None, "goodput_rps": 0.0}
    assert s["captured_tpot_vs_eager"] == {"mixed@2.0": pytest.approx(0.9), "fixed@2.0": pytest.approx(1.1)}
    assert s["captured_le_eager"] is False  # the fixed run's captured TPOT was above eager's
    text = "\n".join(summary_lines(s))
    assert "elastic / dp2 short-request TTFT p50: median 1.12x" in text and "ranks are approximate" in text
    assert "long-request TTFT p50 PCP 2 / dp2 at the lowest rate: 0.55x" in text
    # a layout missing or a zero denominator gives None, never a ZeroDivisionError
    e = summary({"results": [_row("mixed", 1.0, "pcp2-dcp2-elastic", 100.0, 0.0, 0.0),
                             _row("mixed", 1.0, "pcp2-dcp2", 100.0, 0.0, 0.0)]})
    assert e["elastic_short_vs_dp2"]["median"] is None and e["elastic_long_vs_pcp2"]["median"] is None
    assert e["long_pcp2_vs_dp2_lowest_rate"] is None and e["captured_le_eager"] is None
    assert "median -" in "\n".join(summary_lines(e))


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in ("openai", "fastapi", "uvicorn")),
                    reason="openai / fastapi / uvicorn not installed (the dev extra has them)")
def test_quick_run_reports_every_layout_as_pure_json(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    png = tmp_path / "serve.png"
    # the mixed workload only: the fixed one runs the same servers (its rows and summary: the unit tests above)
    out = subprocess.run([sys.executable, "-m", "cpattn", "bench", "serve", "--quick", "--workloads", "mixed",
                          "--json", "-", "--plot", str(png)], capture_output=True, text=True, timeout=900, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    payload = json.loads(out.stdout)  # stdout is JSON alone; the table and progress went to stderr
    assert "TTFT p50/p90/p99" in out.stderr
    rows = payload["results"]
    assert {(r["workload"], r["layout"]) for r in rows} == {("mixed", n) for n in LAYOUTS}
    for r in rows:
        assert r["failed"] == 0 and r["completed"] == r["requests"] == 3, r
        assert r["output_tokens"] >= 3 * 4, r  # every request streamed its tokens (4-8 or 6 each)
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert all(math.isfinite(r[metric][p]) and r[metric][p] > 0 for p in ("p50", "p90", "p99")), (metric, r)
        assert r["request_throughput_rps"] > 0 and r["output_tokens_per_s"] > 0
    captured = ("dcp2-graph", "pcp2-dcp2-elastic")  # the layouts with --compilation-config FULL_DECODE_ONLY
    graph = [r for r in rows if r["layout"] in captured]
    assert len(graph) == 2 and all(r["replayed_steps"] > 0 for r in graph), graph  # captured decode steps under load
    assert all(r["replayed_steps"] == 0 for r in rows if r["layout"] not in captured)
    assert all(r["pcp_steps"] > 0 for r in rows if r["layout"] in ("pcp2-dcp2", "pd-2-2")), rows  # PCP prefill ran
    assert all(r["pcp_steps"] == 0 for r in rows if r["layout"] in ("dp2", "dcp2", "dcp2-graph")), rows
    assert "elastic / dp2 short-request TTFT p50" in out.stderr and "ranks are approximate" in out.stderr
    assert set(payload["summary"]["mixed"]["4.0"]) == set(LAYOUTS)
    mixed = [r for r in rows if r["workload"] == "mixed"]
    assert all(r["prefix_hit_rate"] > 0 for r in mixed), mixed  # the shared prefix was found again
    assert png.stat().st_size > 1000
    assert payload["settings"]["executor"] == "mp"  # multi-rank servers ran their ranks as gloo processes
