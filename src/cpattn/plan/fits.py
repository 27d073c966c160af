"""When no layout fits: which memory term overflows, and the smallest changes that make one fit.

:func:`fit_changes` looks at the layout that misses by the fewest bytes,
takes the term it overflows (:func:`cpattn.plan.memory.memory_terms`) and
tries the changes that shrink that term, smallest first, each checked by
recomputing every layout's memory (only memory: no timing):

- weights: the next smaller weight dtype (``--weights fp8``, then ``int4``),
  then twice the devices;
- activations: a smaller ``--max-batched-tokens`` (halved, down to 512);
- KV: ``--kv-cache-dtype fp8``, then the largest ``--batch`` that fits, the
  longest ``--context`` (a multiple of 1024), twice the devices.

Each change that fits is returned with the layouts it fits on.

Example
-------
>>> from cpattn.plan.model import Options
>>> from cpattn.plan.profiles import get_profile
>>> from cpattn.plan.specs import get_model
>>> ch = fit_changes(get_model("glm-5"), get_profile("h200"), 8, 131072, 1, Options())
>>> ch[0]["change"], ch[0]["term"], ch[0]["layouts"][:1]
('--weights fp8', 'weights', ['tp=1 pcp=8 dcp=1'])
"""

from __future__ import annotations

import dataclasses

from cpattn.plan.memory import memory_terms
from cpattn.plan.rules import layout_space
from cpattn.plan.specs import WEIGHT_BYTES

WEIGHT_STEPS = ("fp8", "int4")  # smaller weight dtypes tried, largest first


def _fitting(spec, prof, devices, context, batch, opts) -> list[str]:
    lays = layout_space(spec, devices, opts.allow_pcp_with_dcp)[0]
    return [str(lay) for lay in lays if memory_terms(spec, prof, lay, context, batch, opts)["overflow"] is None]


def _largest(fits, low: int, high: int, step: int = 1) -> int | None:
    """The largest multiple of ``step`` in [low, high] for which ``fits`` holds (monotone), or None."""
    lo, hi = max(1, low // step), high // step
    if lo > hi or not fits(lo * step):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step


def worst_term(spec, prof, devices: int, context: int, batch: int, opts) -> dict | None:
    """``memory_terms`` of the layout that misses by the fewest bytes (None when one fits or none is accepted)."""
    lays = layout_space(spec, devices, opts.allow_pcp_with_dcp)[0]
    terms = [memory_terms(spec, prof, lay, context, batch, opts) for lay in lays]
    if not terms or any(t["overflow"] is None for t in terms):
        return None
    order = {"max_requests": 0, "KV": 1, "activations": 2, "weights": 3}
    return min(terms, key=lambda t: (order[t["overflow"]], t["short"]))


def _candidates(term, spec, prof, devices, context, batch, opts):
    """(change, (spec, devices, context, batch, opts)) that shrink ``term``, smallest first; the batch and
    context ones are already the largest that fit (None when no value does)."""
    if term == "weights":
        for dt in WEIGHT_STEPS:
            if WEIGHT_BYTES[dt] < spec.weight_bytes():
                yield f"--weights {dt}", (spec.replace(weights=dt), devices, context, batch, opts)
    if term == "activations":
        n = _largest(lambda n: bool(_fitting(spec, prof, devices, context, batch,
                                            dataclasses.replace(opts, max_batched_tokens=n))),
                     512, opts.max_batched_tokens - 1, 256)
        if n:
            yield f"--max-batched-tokens {n}", (spec, devices, context, batch,
                                                dataclasses.replace(opts, max_batched_tokens=n))
    if term == "KV":
        if WEIGHT_BYTES[spec.kv_dtype] > 1:
            yield "--kv-cache-dtype fp8", (spec.replace(kv_dtype="fp8"), devices, context, batch, opts)
        b = _largest(lambda n: bool(_fitting(spec, prof, devices, context, n, opts)), 1, batch - 1)
        if b:
            yield f"--batch {b}", (spec, devices, context, b, opts)
        c = _largest(lambda n: bool(_fitting(spec, prof, devices, n, batch, opts)), 1024, context - 1, 1024)
        if c:
            yield f"--context {c}", (spec, devices, c, batch, opts)
    if term in ("weights", "KV"):
        yield f"--devices {2 * devices}", (spec, 2 * devices, context, batch, opts)


def fit_changes(spec, prof, devices: int, context: int, batch: int, opts, shown: int = 3,
                depth: int = 1) -> list[dict]:
    """Up to ``shown`` changes (smallest first) that make some layout fit: ``{"change", "term", "layouts"}``.
    A change that cures its term but leaves another overflowing is combined with that term's first cure
    (``depth`` levels), e.g. ``--weights int4 and --batch 5``."""
    worst = worst_term(spec, prof, devices, context, batch, opts)
    if worst is None:
        return []
    term, out = worst["overflow"], []
    for change, args in _candidates(term, spec, prof, devices, context, batch, opts):
        if change.startswith("--weights") and any(o["change"].startswith("--weights") for o in out):
            continue  # one weight dtype is enough: the smallest step that fits
        fits = _fitting(args[0], prof, *args[1:])
        if fits:
            out.append({"change": change, "term": term, "layouts": fits})
        elif depth > 0:
            more = fit_changes(args[0], prof, *args[1:], shown=1, depth=depth - 1)
            if more:
                out.append({"change": f"{change} and {more[0]['change']}", "term": term,
                            "layouts": more[0]["layouts"]})
        if len(out) >= shown:
            break
    return out[:shown]
