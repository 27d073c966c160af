"""Small shared pieces of the benchmarks and the main job: timing, tables, a progress bar."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def time_ranks(group, fn: Callable[[], object], reps: int, warmup: int = 0) -> tuple[float, object]:
    """Median wall time of ``fn()`` over ``reps`` runs, every rank starting together.

    Each run is framed by two barriers (an all_reduce of one element), so the
    time is that of the slowest rank. Returns (seconds, last result).
    """
    sync = (lambda: group.all_reduce(torch.zeros(1))) if group is not None else (lambda: None)
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def back_to_back(group, device="cpu", inner: int = 5) -> Callable[[Callable[[], object]], float]:
    """``once(fn)``: seconds per call of ``fn`` over ``inner`` back-to-back calls between two barriers.

    For steps that run back to back (decode steps, collectives): framing each
    single call by barriers would add two collectives to every sample. The
    barriers make the time the slowest rank's; the closing barrier's own
    cost (the median of nine empty samples, measured here once) is taken
    off each sample. CUDA work is synchronised.

    Example
    -------
    >>> from cpattn.comm.sim import SimMesh
    >>> once = back_to_back(SimMesh(1).groups()[0])
    >>> once(lambda: sum(range(1000))) >= 0.0
    True
    """
    sync = (lambda: group.all_reduce(torch.zeros(1, device=device))) if group.size > 1 else (lambda: None)
    cuda = torch.device(device).type == "cuda"

    def window(fn):
        sync()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if cuda:
            torch.cuda.synchronize()
        sync()
        return time.perf_counter() - t0

    base = statistics.median(window(lambda: None) for _ in range(9))  # the closing barrier alone

    def once(fn):
        return max(window(fn) - base, 0.0) / inner

    return once


class Progress:
    """A one-line text progress bar on stderr: ``[#####-----] 3/6 ring``."""

    def __init__(self, total: int, width: int = 24, enabled: bool = True):
        self.total, self.done, self.width, self.enabled = total, 0, width, enabled

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // max(self.total, 1)
        end = "\n" if self.done >= self.total else ""
        sys.stderr.write(f"\r[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} {label:<40}{end}")
        sys.stderr.flush()


def table(rows: list[dict], columns: list[str]) -> str:
    """Format rows (dicts) as a fixed-width text table with the given columns."""
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` as JSON to ``path`` ("-" for stdout, None to skip)."""
    if path is None:
        return
    text = json.dumps(payload, indent=2, default=str)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
