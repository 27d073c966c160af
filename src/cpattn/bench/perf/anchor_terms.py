"""Deprecated (one release): the three-terms-through-three-cells solve of the PCP anchor's columns.

:func:`pcp_terms` and :func:`ttft_terms` solved each published TTFT column
exactly as ``constant + per-token * x + attention * x**2`` through its three
cells: zero degrees of freedom, so the terms hold whatever the cells hold
(noise and rounding included; Qwen3's PCP column came out with a negative
constant). They explained nothing and nothing in the library calls them. Use
the absolute anchors instead: :func:`cpattn.bench.perf.anchors.pcp_anchor`
(``abs_base`` / ``abs_pcp``: predicted over published TTFT per cell),
:func:`~cpattn.bench.perf.anchors.v4_anchor`, :func:`~cpattn.bench.perf.anchors.llama_anchor`
and :func:`~cpattn.bench.perf.anchors.dcp_anchor`. Both names stay importable from
:mod:`cpattn.bench.perf.anchors` and warn when called.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as w:
...     warnings.simplefilter("always")
...     _ = ttft_terms([32768, 65536, 131072], [6.0, 17.0, 57.0])
>>> w[0].category.__name__, "pcp_anchor" in str(w[0].message)
('DeprecationWarning', True)
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np

from cpattn.bench.common import safe_div

PUBLISHED_HALF_UNIT = 0.05  # s: the PCP table prints TTFTs to one decimal
REPLACED_BY = ("the absolute anchors: cpattn.bench.perf.anchors.pcp_anchor (abs_base / abs_pcp), v4_anchor, "
               "llama_anchor, dcp_anchor")


def _warn(name: str) -> None:
    warnings.warn(f"cpattn.bench.perf.anchors.{name} is deprecated and will be removed in the next release; use "
                  f"{REPLACED_BY}", DeprecationWarning, stacklevel=3)


def _solve(contexts, seconds, unit: int) -> tuple[float, float, float]:
    x = np.asarray(contexts, dtype=np.float64) / unit
    if x.shape != (3,) or len(set(x.tolist())) != 3:
        raise ValueError(f"ttft_terms needs three distinct contexts, got {list(contexts)}")
    f, u, a = np.linalg.solve(np.stack([np.ones(3), x, x * x], 1), np.asarray(seconds, dtype=np.float64))
    return float(f), float(u), float(a)


def ttft_terms(contexts, seconds, unit: int = 32768) -> tuple[float, float, float]:
    """Deprecated (module doc): the terms ``(f, u, a)`` of ``f + u * x + a * x**2`` through three points,
    ``x = context / unit``. contexts, seconds: [3] tokens and seconds."""
    _warn("ttft_terms")
    return _solve(contexts, seconds, unit)


def _column_terms(ctx, base, pcp) -> dict:
    (fb, ub, ab), (fp, up, ap) = _solve(ctx, base, 32768), _solve(ctx, pcp, 32768)
    return {"constant_32k_s": fb, "pcp_constant_s": fp, "per_token_32k_s": ub, "attention_32k_s": ab,
            "per_token_ratio": safe_div(up, ub), "attention_ratio": safe_div(ap, ab)}


def pcp_terms(rows: list[dict] | None = None, half_unit: float = PUBLISHED_HALF_UNIT) -> list[dict]:
    """Deprecated (module doc): each model's baseline and PCP TTFT columns of
    :func:`~cpattn.bench.perf.anchors.pcp_anchor` split by :func:`ttft_terms`, published and predicted, with each
    value's [low, high] over every rounding of the published cells (+- ``half_unit`` s; NaN where a
    denominator reaches 0)."""
    _warn("pcp_terms")
    if rows is None:
        from cpattn.bench.perf.anchors import pcp_anchor

        rows = pcp_anchor()
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        ctx = [r["context"] for r in mine]
        for source, keys, half in (("published", ("published_base_s", "published_pcp_s"), half_unit),
                                   ("predicted", ("ttft_base_s", "ttft_pcp2_s"), 0.0)):
            cells = np.array([[r[k] for r in mine] for k in keys])  # [2 (base, pcp), 3 contexts]
            mid = _column_terms(ctx, *cells)
            corners = [_column_terms(ctx, *(cells + np.reshape(d, (2, 3))))
                       for d in itertools.product((-half, half), repeat=6)]
            vals = {k: [c[k] for c in corners] for k in mid}
            span = {k: [min(v), max(v)] if all(map(math.isfinite, v)) else [math.nan, math.nan]
                    for k, v in vals.items()}
            out.append({"model": name, "source": source, **mid, "range": span})
    return out
