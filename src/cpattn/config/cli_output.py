"""Text tables and JSON output for the command lines (plan, bench, serve reports); torch-free.

>>> print(table([{"model": "qwen3", "ttft_ms": 215.0}], ["model", "ttft_ms"]))
model  ttft_ms
-----  -------
qwen3      215
"""

from __future__ import annotations

import json
import math
import sys


def _g(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def table(rows: list[dict], columns: list[str]) -> str:
    """Format rows (dicts) as a fixed-width text table with the given columns.

    >>> print(table([{"a": 1, "b": 0.5}], ["a", "b"]))
    a    b
    -  ---
    1  0.5
    """
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return _g(v) if abs(v) < 1000 or math.isnan(v) else f"{v:,.0f}"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _plain(x):
    """JSON-safe: NaN / inf -> None, tuples -> lists, dataclass-like objects via ``as_dict``."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "as_dict"):
        return _plain(x.as_dict())
    return x


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` as JSON to ``path`` ("-" for stdout, None to skip); NaN is written as null.

    >>> write_json("-", {"ratio": float("nan"), "rows": (1, 2)})
    {
      "ratio": null,
      "rows": [
        1,
        2
      ]
    }
    """
    if path is None:
        return
    text = json.dumps(_plain(payload), indent=2, default=str)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
