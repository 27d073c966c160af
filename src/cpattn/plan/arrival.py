"""Goodput under steady arrival: requests arriving as a Poisson process, TTFT as an M/D/1 queue on the prefill.

An approximation, stated here whole. Requests of ``context`` tokens arrive
as a Poisson process at ``rate`` requests/s, dealt evenly over the ``dp``
replicas (each a Poisson process at ``rate / dp``). A replica prefills them
one at a time, first come first served, each in the deterministic time
``S`` of one request's prefill (:func:`cpattn.plan.model.prefill_time` at
batch 1): an M/D/1 queue with load ``rho = (rate / dp) * S``. Decode steps
are not queued behind prefills (continuous batching runs them between
prefill steps); their cost is the TPOT at the steady concurrency of
Little's law, ``N = rate * (E[TTFT] + output_len * TPOT(N))``, solved by
fixed-point iteration. TTFT = wait + ``S``, with

- mean wait (Pollaczek-Khinchine, deterministic service):
  ``E[W] = rho * S / (2 * (1 - rho))``;
- the wait's tail (Cramer-Lundberg, exact in the limit of large waits):
  ``P(W > t) ~ C * exp(-theta * t)``, ``theta = x / S`` with ``x > 0`` the
  root of ``rho * (exp(x) - 1) = x``, and ``C = (1 - rho) / (x + rho - 1)``;
  the ``q`` quantile ``t_q = ln(C / (1 - q)) / theta``, and ``0`` where
  ``1 - q >= rho`` (``P(W > 0) = rho`` exactly: an arrival finds the server
  idle with probability ``1 - rho``).

Against a discrete-event simulation of the same queue
(``tests/test_plan_arrival.py``) the p99 is within 2% for ``rho`` up to
0.85. ``rho >= 1``: the queue grows without bound (TTFT infinite). Not
modelled: chunked prefill interleaving a long prompt with others, batching
short prompts into one step (the burst model of :func:`request_ttfts` does),
prompt-length variance (M/G/1), preemption.

Example
-------
>>> w = md1_wait(rate=0.5, service=1.0, q=0.99)  # rho = 0.5
>>> round(w["mean"], 3), round(w["quantile"], 2)
(0.5, 3.34)
>>> md1_wait(rate=0.2, service=1.0, q=0.5)["quantile"]  # rho = 0.2 < 1 - q: half find the server idle
0.0
"""

from __future__ import annotations

import math


def _decay(rho: float) -> float:
    """The root ``x > 0`` of ``rho * (exp(x) - 1) = x`` (0 < rho < 1), by bisection."""
    def f(x):
        return rho * math.expm1(x) - x

    lo, hi = 0.0, 1.0
    while f(hi) <= 0:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(mid) > 0:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-15 * hi:
            break
    return hi


def md1_wait(rate: float, service: float, q: float = 0.99) -> dict:
    """The M/D/1 wait before service (module doc) of arrivals at ``rate`` per second served in ``service``
    seconds each: ``{"rho", "mean", "quantile"}`` (``quantile``: the ``q`` quantile; both ``inf`` when
    ``rho >= 1``)."""
    if rate < 0 or service <= 0 or not 0 < q < 1:
        raise ValueError(f"md1_wait: saw rate={rate}, service={service}, q={q}; rule: rate >= 0, service > 0, "
                         "0 < q < 1; fix: pass a request rate, a positive prefill time and a quantile in (0, 1)")
    rho = rate * service
    if rho >= 1:
        return {"rho": rho, "mean": math.inf, "quantile": math.inf}
    mean = rho * service / (2 * (1 - rho))
    if rho == 0 or 1 - q >= rho:
        return {"rho": rho, "mean": mean, "quantile": 0.0}
    x = _decay(rho)
    c = (1 - rho) / (x + rho - 1)
    return {"rho": rho, "mean": mean, "quantile": max(0.0, math.log(c / (1 - q)) * service / x)}


def at_rate(spec, prof, lay, *, context: int, rate: float, opts, iterations: int = 8) -> dict:
    """One layout under Poisson arrivals at ``rate`` requests/s (module doc): ``service_s`` (one prefill),
    ``rho``, ``ttft_mean_s`` / ``ttft_p50_s`` / ``ttft_p99_s``, ``concurrency`` (Little's law), ``tpot_s``
    there and ``fits`` (that concurrency's KV fits)."""
    from cpattn.plan.model import decode_time, predict

    one = predict(spec, prof, lay, context=context, batch=1, opts=opts)
    s = one.ttft_s
    per = rate / lay.dp
    w50, w99 = md1_wait(per, s, 0.5), md1_wait(per, s, 0.99)
    out = {"rate": rate, "service_s": s, "rho": w99["rho"], "ttft_mean_s": s + w99["mean"],
           "ttft_p50_s": s + w50["quantile"], "ttft_p99_s": s + w99["quantile"]}
    if math.isinf(w99["mean"]):
        return {**out, "concurrency": math.inf, "tpot_s": math.inf, "fits": False}
    n, tpot = 1, one.tpot_s
    for _ in range(iterations):  # N = rate * (E[TTFT] + output * TPOT(N))
        n = max(1, math.ceil(rate * (out["ttft_mean_s"] + opts.output * tpot)))
        tpot = decode_time(spec, prof, lay, context, n, opts)["total"]
    return {**out, "concurrency": n, "tpot_s": tpot, "fits": one.fits and n <= one.max_requests}


def arrival_goodput(spec, prof, lay, *, context: int, slo, opts, rate: float | None = None,
                    steps: int = 20) -> dict:
    """The largest Poisson rate whose p99 TTFT and TPOT meet ``slo`` with the steady concurrency in memory
    (bisection: both grow with the rate): ``max_rate`` (requests/s), ``requests_per_s_per_device``,
    ``tokens_per_s_per_device`` (``max_rate * output / devices``), ``concurrency`` there; and, when ``rate``
    is given, ``at`` (:func:`at_rate` there) and ``meets_at_rate``.

    >>> from cpattn.plan.model import Layout, Options
    >>> from cpattn.plan.objective import SLO
    >>> from cpattn.plan.profiles import get_profile
    >>> from cpattn.plan.specs import get_model
    >>> g = arrival_goodput(get_model("deepseek-r1"), get_profile("h200"), Layout(8, 1, 8), context=8192,
    ...                     slo=SLO(ttft_s=2.0, tpot_s=0.05), opts=Options(output=256), rate=1.0)
    >>> g["max_rate"] > 1.0, g["meets_at_rate"], g["at"]["ttft_p99_s"] <= 2.0
    (True, True, True)
    """
    def ok(r):
        a = at_rate(spec, prof, lay, context=context, rate=r, opts=opts)
        return a, a["fits"] and slo.met(a["ttft_p99_s"], a["tpot_s"])

    hi = lay.dp / at_rate(spec, prof, lay, context=context, rate=0.0, opts=opts)["service_s"]  # rho = 1
    lo, best = 0.0, None
    for _ in range(steps):
        mid = (lo + hi) / 2
        a, good = ok(mid)
        lo, hi, best = (mid, hi, a) if good else (lo, mid, best)
    if best is None:
        a0, good0 = ok(1e-9)
        best, lo = (a0, 1e-9) if good0 else (None, 0.0)
    out = {"max_rate": lo, "requests_per_s_per_device": lo / lay.devices,
           "tokens_per_s_per_device": lo * opts.output / lay.devices,
           "concurrency": best["concurrency"] if best else 0, "arrival": "poisson"}
    if rate is not None:
        at, good = ok(rate)
        out.update(at=at, meets_at_rate=good)
    return out
