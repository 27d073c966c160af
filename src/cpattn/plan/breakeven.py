"""The prompt length above which PCP lowers TTFT: what a serving engine needs to pick each request's PCP degree.

:func:`pcp_break_even` compares, for one request of ``L`` new tokens, the
prefill of a PCP layout (``tp`` x ``pcp`` ranks split the tokens) with the
same request on one PCP rank of the same engine (``Layout(tp, 1, dp=pcp)``:
the other ranks are free, the experts stay spread over all the devices) and
returns the smallest ``L`` (a multiple of ``step``) from which PCP is
faster, found by bisection (PCP's gain grows with ``L``: the attention is
quadratic, the exchange and the per-step latencies are not). Both layouts
go through the engine's rule check (:func:`cpattn.plan.rules.check_layout`).

:func:`bench_break_even` is the same question for ``cpattn bench pcp`` on a
calibrated CPU profile (attention alone: :func:`cpattn.plan.bench_model.predict_pcp`),
the one a run of the benchmark at lengths around it can check.

Example
-------
>>> from cpattn.plan.model import Layout
>>> from cpattn.plan.profiles import get_profile
>>> from cpattn.plan.specs import get_model
>>> pcp_break_even(get_model("deepseek-r1"), Layout(4, 2), get_profile("h200"))  # the roofline: GEMMs halve
128
"""

from __future__ import annotations

from cpattn.plan.model import Layout, Options, prefill_time
from cpattn.plan.rules import check_layout


def _resolve(model, profile):
    from cpattn.plan.profiles import get_profile
    from cpattn.plan.specs import get_model

    return (get_model(model) if isinstance(model, str) else model,
            get_profile(profile) if isinstance(profile, str) else profile)


def pcp_ttfts(spec, prof, lay: Layout, tokens: int, opts: Options = Options(),
              baseline: Layout | None = None) -> tuple[float, float]:
    """(TTFT with ``lay``'s PCP, TTFT with ``baseline``) of one request of ``tokens``; ``baseline`` defaults to
    one PCP rank of the same engine, ``Layout(tp, 1, dp=pcp * dp)``."""
    one = baseline or Layout(lay.tp, 1, 1, dp=lay.pcp * lay.dp)
    return (prefill_time(spec, prof, lay, tokens, 1, opts)["total"],
            prefill_time(spec, prof, one, tokens, 1, opts)["total"])


def pcp_break_even(model, layout: Layout, profile, *, opts: Options = Options(), step: int = 64,
                   max_tokens: int = 1 << 24, baseline: Layout | None = None) -> int | None:
    """The smallest prompt length (tokens, a multiple of ``step``) above which PCP over ``layout.pcp`` ranks
    lowers one request's TTFT versus one rank (or versus ``baseline``, e.g. the same ranks as attention TP,
    ``Layout(tp * pcp, dp=dp)``: the question a static-CP deployment asks); ``step`` when PCP wins from the
    shortest prompt, None when it never does up to ``max_tokens``. ``model`` / ``profile``: a spec / profile
    or its name. Both layouts go through the engine's rule check."""
    spec, prof = _resolve(model, profile)
    if layout.pcp < 2:
        raise ValueError(f"layout: saw {layout} (pcp={layout.pcp}); rule: a break-even needs pcp >= 2; "
                         "fix: pass e.g. Layout(tp, 2)")
    check_layout(spec, layout, opts.allow_pcp_with_dcp)
    check_layout(spec, baseline or Layout(layout.tp), opts.allow_pcp_with_dcp)

    def wins(n):
        pcp, one = pcp_ttfts(spec, prof, layout, n, opts, baseline)
        return pcp < one

    return _first(wins, step, max_tokens)


def _first(wins, step: int, high: int) -> int | None:
    """The smallest multiple of ``step`` up to ``high`` where ``wins`` holds (monotone), or None."""
    lo, hi = 1, high // step
    if wins(lo * step):
        return lo * step
    if not wins(hi * step):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid * step) else (mid, hi)
    return hi * step


def bench_break_even(prof, *, heads: int = 32, kv_heads: int = 8, head_dim: int = 128, pcp: int = 2,
                     clock: str = "wall", max_tokens: int = 1 << 17) -> int | None:
    """The shortest ``cpattn bench pcp`` request (tokens, a multiple of ``2 * pcp * 16``) whose predicted
    ring time is below one rank's (:func:`cpattn.plan.bench_model.predict_pcp` ratio < 1), or None.

    >>> from cpattn.plan.profiles import CPU_DEFAULT
    >>> n = bench_break_even(CPU_DEFAULT)
    >>> n is None or n % 64 == 0
    True
    """
    from cpattn.plan.bench_model import predict_pcp

    step = 2 * pcp * 16

    def wins(n):
        return predict_pcp(prof, seq=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, pcp=pcp,
                           clock=clock)["ratio"] < 1.0

    return _first(wins, step, max_tokens)
