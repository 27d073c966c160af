"""``cpattn plan validate``'s experiment: the model's predicted ratios of ``cpattn bench pcp / dcp / graph``
next to the measured ones.

The predictions are the library's (:mod:`cpattn.plan.bench_model`:
``predict_pcp``, ``predict_dcp``, ``predict_graph``, ``profile_gaps``); this
module reads the measured ratios out of the benchmarks' ``--json`` output
(:func:`measured_pcp`, :func:`measured_dcp`, :func:`measured_graph`), puts
both side by side with the relative error (:func:`table`) and says where the
model departs from the naive 1/P guess (:func:`where_the_model_earns_its_keep`).

Example
-------
>>> table([("bench pcp: ring / one rank", 0.55, 0.5, 0.5)])[0]["error"]  # doctest: +ELLIPSIS
0.1000...
"""

from __future__ import annotations


def measured_pcp(result: dict, clock: str = "wall") -> float | None:
    """ring / one rank (median of per-round ratios, wall or CPU time) from ``cpattn bench pcp --json``."""
    row = next((r for r in result.get("rows", []) if r["method"] == "ring"), None)
    return None if row is None else row["cpu_vs_one_rank" if clock == "cpu" else "vs_one_rank"]


def measured_dcp(result: dict, context: int, clock: str = "wall") -> dict:
    """Whole-step DCP / one rank per variant (median of per-round ratios) from ``cpattn bench dcp --json``."""
    out, tail = {}, f"_{clock}_ms"
    for r in result.get("rows", []):
        m = r.get("metric", "")
        if r.get("context") == context and m.startswith("step_") and m.endswith(tail):
            out[m[len("step_"):-len(tail)]] = r["ratio"]["median"]
    return out


def measured_graph(result: dict) -> dict:
    """Eager / graph speedup per batch (median of per-round ratios) from ``cpattn bench graph --json``."""
    rows = result["cpu"][0]["rows"]
    return {r["batch"]: r["speedup"] for r in rows}


def table(pairs: list[tuple]) -> list[dict]:
    """Rows of (what, predicted, measured[, naive]) with the relative error |p - m| / m (None when not
    measured); ``naive``: what the naive guess (1/P of one rank's time) says, and its error the same way.

    >>> table([("pcp", 0.55, 0.5, 0.5)])[0]["naive_error"], table([("graph", 2.0, None)])[0]["naive"]
    (0.0, None)
    """
    rows = []
    for what, pred, meas, *rest in pairs:
        naive = rest[0] if rest else None
        err = None if meas is None or meas <= 0 else abs(pred - meas) / meas
        nerr = None if err is None or naive is None else abs(naive - meas) / meas
        rows.append({"what": what, "predicted": pred, "measured": meas, "error": err,
                     "within_15%": None if err is None else err <= 0.15, "naive": naive, "naive_error": nerr,
                     "naive_within_15%": None if nerr is None else nerr <= 0.15})
    return rows


def where_the_model_earns_its_keep(rows: list[dict], break_even: int | None, clock: str = "wall",
                                   margin: float = 0.15) -> dict:
    """Where the model says something the naive 1/P guess does not: the rows of :func:`table` whose prediction
    departs from 1/P by more than ``margin`` (the merge- or exchange-bound ones; with a measurement, who was
    right), and the PCP break-even (1/P says PCP wins at every length; ``break_even``: the model's length,
    :func:`cpattn.plan.breakeven.bench_break_even`). ``line``: the sentence ``cpattn plan validate`` prints.

    >>> r = table([("dcp merge-bound", 0.9, 0.85, 0.5), ("pcp", 0.52, 0.6, 0.5)])
    >>> k = where_the_model_earns_its_keep(r, 4096)
    >>> k["departs"], k["model_right"], k["naive_right"]
    (['dcp merge-bound'], 1, 0)
    """
    departs = [r for r in rows if r["naive"] is not None and abs(r["predicted"] - r["naive"]) > margin * r["naive"]]
    judged = [r for r in departs if r["error"] is not None]
    model_right = sum(bool(r["within_15%"]) for r in judged)
    naive_right = sum(bool(r["naive_within_15%"]) for r in judged)
    names = "; ".join(f"{r['what']} (model {r['predicted']:.3g}, 1/P {r['naive']:.3g}" +
                      ("" if r["measured"] is None else f", measured {r['measured']:.3g}") + ")" for r in departs)
    line = (f"where the model earns its keep: {len(departs)} of {sum(r['naive'] is not None for r in rows)} "
            f"PCP / DCP rows depart from 1/P by more than {margin:.0%} (the merge- or exchange-bound ones"
            + (f": {names}" if departs else "") + ")"
            + (f"; measured on {len(judged)}: the model within {margin:.0%} on {model_right}, 1/P on {naive_right}"
               if judged else "")
            + "; and the PCP break-even: 1/P says the ring wins at every length, the model "
            + (f"from {break_even} tokens ({clock} clock)" if break_even else "that it never wins on this profile"))
    return {"departs": [r["what"] for r in departs], "measured": len(judged), "model_right": model_right,
            "naive_right": naive_right, "break_even": break_even, "line": line}
