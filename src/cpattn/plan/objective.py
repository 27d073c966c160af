"""The recommendation for the objective a user has: TTFT, TPOT, throughput or goodput under SLOs.

Objectives (each over the layouts that fit, and meet the SLOs when given):

- ``ttft``: the lowest per-request TTFT at the 99th percentile under the
  batch's concurrency (:func:`cpattn.plan.model.request_ttfts`);
- ``tpot``: the lowest time per output token at that concurrency;
- ``throughput``: the most output tokens/s per device at the largest
  concurrency memory holds;
- ``goodput``: the most output tokens/s per device at the largest
  concurrency whose p99 TTFT and TPOT meet ``--ttft-slo`` / ``--tpot-slo``
  (:func:`goodput`; closed loop: each of ``c`` requests takes its median
  TTFT plus ``output_len`` TPOTs, so ``c / (ttft_p50 + output_len * tpot)``
  requests/s per engine); with a request rate (``--request-rate``) requests
  arrive as a Poisson process instead of one burst, TTFT is priced as an
  M/D/1 queue on the prefill, and goodput is the largest rate whose p99
  TTFT and TPOT meet the SLOs (:func:`cpattn.plan.arrival.arrival_goodput`,
  its formulas and what it leaves out in :mod:`cpattn.plan.arrival`).

Layouts within ``tolerance`` (2%) of the best score are a tie: the tie is
reported as such and broken by the next metric (TTFT: TPOT; TPOT: TTFT;
throughput and goodput: TPOT), never by noise in the first.

Example
-------
>>> from cpattn.plan.model import Layout, layouts, predict
>>> from cpattn.plan.profiles import get_profile
>>> from cpattn.plan.specs import get_model
>>> spec, prof = get_model("deepseek-r1"), get_profile("h200")
>>> preds = [predict(spec, prof, lay, context=131072, batch=1) for lay in layouts(spec, 8)]
>>> r = rank(preds, "tpot")
>>> str(r["best"].layout), len(r["ties"]) >= 1
('tp=8 pcp=1 dcp=8', True)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

OBJECTIVES = ("ttft", "tpot", "throughput", "goodput")
NEXT = {"ttft": "tpot", "tpot": "ttft", "throughput": "tpot", "goodput": "tpot"}


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds (None: none): p99 TTFT and TPOT."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_p99_s: float, tpot_s: float) -> bool:
        return ((self.ttft_s is None or ttft_p99_s <= self.ttft_s)
                and (self.tpot_s is None or tpot_s <= self.tpot_s))

    def __bool__(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


def goodput(spec, prof, lay, *, context: int, slo: SLO, opts, max_concurrency: int | None = None) -> dict:
    """The largest concurrency ``c`` (up to what memory holds) whose p99 TTFT and TPOT meet ``slo``, and its
    requests and output tokens per second per device (module doc); ``c == 0``: not even one request meets it.

    >>> from cpattn.plan.model import Layout, Options
    >>> from cpattn.plan.profiles import get_profile
    >>> from cpattn.plan.specs import get_model
    >>> g = goodput(get_model("deepseek-r1"), get_profile("h200"), Layout(8, 1, 8), context=8192,
    ...             slo=SLO(ttft_s=5.0, tpot_s=0.05), opts=Options(output=256))
    >>> g["concurrency"] > 1, g["ttft_p99_s"] <= 5.0, g["tpot_s"] <= 0.05
    (True, True, True)
    """
    from cpattn.plan.model import predict

    def at(c):
        return predict(spec, prof, lay, context=context, batch=c, opts=opts)

    one = at(1)
    cap = one.max_requests if max_concurrency is None else min(one.max_requests, max_concurrency)
    ok = lambda p: p.fits and slo.met(p.ttft_p99_s, p.tpot_s)  # noqa: E731
    if cap < 1 or not ok(one):
        return {"concurrency": 0, "requests_per_s_per_device": 0.0, "tokens_per_s_per_device": 0.0,
                "ttft_p99_s": one.ttft_p99_s, "tpot_s": one.tpot_s}
    lo, hi, best = 1, cap, one
    while lo < hi:  # p99 TTFT and TPOT grow with the concurrency
        mid = (lo + hi + 1) // 2
        p = at(mid)
        if ok(p):
            lo, best = mid, p
        else:
            hi = mid - 1
    rate = lo / (best.ttft_p50_s + opts.output * best.tpot_s) / lay.devices
    return {"concurrency": lo, "requests_per_s_per_device": rate, "tokens_per_s_per_device": rate * opts.output,
            "ttft_p99_s": best.ttft_p99_s, "tpot_s": best.tpot_s}


def _value(p, objective: str) -> float:
    """The objective's metric of ``p`` (lower is better)."""
    if objective == "ttft":
        return p.ttft_p99_s
    if objective == "tpot":
        return p.tpot_s
    if objective == "throughput":
        return -p.tokens_per_s_per_device
    if objective == "goodput":
        return -p.parts.get("goodput", {}).get("tokens_per_s_per_device", 0.0)
    raise ValueError(f"objective must be one of {OBJECTIVES}; got {objective!r}")


def describe(p, objective: str) -> str:
    """``p``'s metric for ``objective`` in words, e.g. ``TTFT p99 13.0 s``."""
    if objective == "ttft":
        return f"TTFT p99 {_time(p.ttft_p99_s)}"
    if objective == "tpot":
        return f"TPOT {p.tpot_s * 1e3:.2f} ms"
    if objective == "throughput":
        return f"{p.tokens_per_s_per_device:.1f} tok/s per device at {p.max_requests} requests"
    g = p.parts.get("goodput", {})
    if g.get("arrival") == "poisson":
        return (f"goodput {g['tokens_per_s_per_device']:.1f} tok/s per device at up to {g['max_rate']:.3g} "
                f"requests/s (Poisson arrivals)")
    return f"goodput {g.get('tokens_per_s_per_device', 0.0):.1f} tok/s per device at {g.get('concurrency', 0)} requests"


def _time(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def rank(preds: list, objective: str = "ttft", tolerance: float = 0.02, slo: SLO = SLO()) -> dict:
    """``{"best", "ties", "eligible", "per_objective"}``: the pick for ``objective`` among layouts that fit and
    meet ``slo``; ``ties``: the eligible layouts within ``tolerance`` of the best value (the best included),
    from which the next metric (:data:`NEXT`) picked ``best``; ``per_objective``: each objective's pick."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}; got {objective!r}")
    arrival = objective == "goodput" and any(p.parts.get("goodput", {}).get("arrival") for p in preds)
    # under Poisson arrivals the SLOs are judged by the arrival model, not by the burst's TTFT
    eligible = [p for p in preds if p.fits and (not slo or arrival or slo.met(p.ttft_p99_s, p.tpot_s))]
    if objective == "goodput":
        eligible = [p for p in eligible if p.parts.get("goodput", {}).get("concurrency", 0) > 0]
    if not eligible:
        return {"best": None, "ties": [], "eligible": [], "per_objective": {}}
    top = min(_value(p, objective) for p in eligible)
    ties = [p for p in eligible if abs(_value(p, objective) - top) <= tolerance * abs(top)]
    best = min(ties, key=lambda p: (_value(p, NEXT[objective]), _value(p, objective)))
    per = {o: min(eligible, key=lambda p: _value(p, o)) for o in OBJECTIVES
           if o != "goodput" or any("goodput" in p.parts for p in eligible)}
    return {"best": best, "ties": ties, "eligible": eligible, "per_objective": per}


def recommend(preds: list, objective: str = "ttft", tolerance: float = 0.02, slo: SLO = SLO()):
    """(the layout to pick, why) for ``objective`` (:func:`rank`); (None, why) when no layout fits or
    meets the SLOs."""
    r = rank(preds, objective, tolerance, slo)
    best = r["best"]
    if best is None:
        if not any(p.fits for p in preds):
            return None, no_fit_reason(preds)
        near = min((p for p in preds if p.fits), key=lambda p: max(
            p.ttft_p99_s / (slo.ttft_s or math.inf), p.tpot_s / (slo.tpot_s or math.inf)))
        return None, (f"no layout that fits meets the SLOs (TTFT p99 <= {_slo(slo.ttft_s)}, TPOT <= "
                      f"{_slo(slo.tpot_s)}); closest: {near.layout} with TTFT p99 {_time(near.ttft_p99_s)}, "
                      f"TPOT {near.tpot_s * 1e3:.2f} ms")
    n = len(r["eligible"])
    why = f"{best.layout}: best {objective} ({describe(best, objective)}) among the {n} layouts that fit"
    why += " and meet the SLOs" if slo else ""
    others = [p for p in r["ties"] if p is not best]
    if others:
        why += (f"; a tie within {tolerance:.0%} with " + ", ".join(f"{p.layout} ({describe(p, objective)})"
                                                               for p in others)
                + f", broken by {NEXT[objective]}: {describe(best, NEXT[objective])} vs "
                + ", ".join(describe(p, NEXT[objective]) for p in others))
    alt = [f"{o}: {p.layout} ({describe(p, o)})" for o, p in r["per_objective"].items()
           if o != objective and p is not best]
    if alt:
        why += ". Other objectives pick " + "; ".join(alt)
    return best, why


def _slo(x):
    return "-" if x is None else _time(x)


def with_goodput(preds: list, spec, prof, *, context: int, slo: SLO, opts, request_rate: float | None = None) -> list:
    """``preds`` with ``parts["goodput"]`` filled in for the layouts that fit: :func:`goodput` (one burst), or
    with ``request_rate`` :func:`cpattn.plan.arrival.arrival_goodput` (Poisson arrivals, evaluated at that
    rate too)."""
    from cpattn.plan.arrival import arrival_goodput

    out = []
    for p in preds:
        if not p.fits:
            g = {"concurrency": 0, "requests_per_s_per_device": 0.0, "tokens_per_s_per_device": 0.0}
        elif request_rate is not None:
            g = arrival_goodput(spec, prof, p.layout, context=context, slo=slo, opts=opts, rate=request_rate)
        else:
            g = goodput(spec, prof, p.layout, context=context, slo=slo, opts=opts)
        out.append(dataclasses.replace(p, parts={**p.parts, "goodput": g}))
    return out


def no_fit_reason(preds: list[Prediction]) -> str:
    """Why no layout fits: the term each layout overflows (weights, activations, KV), with the bytes.

    >>> from cpattn.plan.profiles import get_profile
    >>> from cpattn.plan.specs import get_model
    >>> spec, prof = get_model("glm-5"), get_profile("h200")
    >>> from cpattn.plan.model import Layout, predict
    >>> no_fit_reason([predict(spec, prof, Layout(8), context=131072, batch=1)])
    'no layout fits in device memory: the weights overflow on 1 of 1 layouts (186 GB per device against 120 GB usable)'
    """
    def gb(xs):
        lo, hi = min(xs) / 1e9, max(xs) / 1e9
        return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"

    parts = []
    for term in ("weights", "activations", "KV", "max_requests"):
        mine = [p for p in preds if p.overflow == term]
        if not mine:
            continue
        m = [p.memory for p in mine]
        n = f"{len(mine)} of {len(preds)} layouts"
        if term == "weights":
            parts.append(f"the weights overflow on {n} ({gb([x['weights'] for x in m])} GB per device against "
                         f"{gb([x['usable'] for x in m])} GB usable)")
        elif term == "activations":
            parts.append(f"the prefill activations overflow on {n} ({gb([x['activations'] for x in m])} GB per "
                         f"device, {gb([x['usable'] - x['weights'] for x in m])} GB left after the weights)")
        elif term == "KV":
            parts.append(f"the batch's KV cache overflows on {n} ({gb([x['KV'] for x in m])} GB per device, "
                         f"{gb([max(0.0, x['kv_capacity']) for x in m])} GB left after weights and activations)")
        else:
            parts.append(f"the scheduler's cap on concurrent requests is below the batch on {n}")
    return "no layout fits in device memory: " + "; ".join(parts)
