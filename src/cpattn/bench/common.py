"""Shared pieces of the benchmarks and the main job: one timing helper, tables, JSON, a progress bar.

Timing. :func:`measure` runs several functions in interleaved rounds (each
round times every function once, starting from a different one), so drift
in machine load hits all alike, and returns each one's :class:`Samples`.
:func:`ratio` pairs the samples of the same round and reports a ratio with
its spread (:class:`Spread`: the best-vs-best ratio and the low / median /
high of the per-round ratios), so a reader sees what is signal. No time is
ever clamped or had a cost subtracted, so no denominator can be 0; a
ratio over a non-positive time is NaN, never an exception.

Example
-------
>>> s = measure({"a": lambda: sum(range(2000)), "b": lambda: sum(range(1000))}, reps=5)
>>> r = ratio(s["a"], s["b"])
>>> r.low <= r.median <= r.high and len(s["a"].wall) == 5
True
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cpattn.config.cli_output import _plain, table, write_json  # noqa: F401 - they lived here

# torch is imported where a function needs it, so a command line parses (and refuses a typo) without it;
# DTYPES (canonical dtype name -> torch dtype, the names of cpattn.config.cli_args.DTYPE_ALIASES) is made on first use
_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def __getattr__(name: str):
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in _DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Samples:
    """Repeated timings of one function, in seconds per call: wall clock and this process's CPU time.

    With a group, each sample is the slowest rank's. ``result`` is the
    function's last return value (on this rank).

    Example
    -------
    >>> s = Samples((0.3, 0.1, 0.2))
    >>> s.best, s.median, s.worst
    (0.1, 0.2, 0.3)
    """

    wall: tuple[float, ...]
    cpu: tuple[float, ...] = ()
    result: object = field(default=None, repr=False, compare=False)

    @property
    def best(self) -> float:
        return min(self.wall)

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def worst(self) -> float:
        return max(self.wall)

    def of(self, clock: str = "wall") -> tuple[float, ...]:
        """The samples of one clock: "wall" or "cpu"."""
        return self.cpu if clock == "cpu" else self.wall

    def as_dict(self, scale: float = 1e3) -> dict:
        """best / median / worst wall time (and CPU time) times ``scale`` (default: milliseconds).

        >>> Samples((0.002, 0.001)).as_dict()
        {'best': 1.0, 'median': 1.5, 'worst': 2.0}
        """
        out = {"best": scale * self.best, "median": scale * self.median, "worst": scale * self.worst}
        if self.cpu:
            out.update(cpu_best=scale * min(self.cpu), cpu_median=scale * statistics.median(self.cpu))
        return out


@dataclass(frozen=True)
class Spread:
    """A ratio of two timings measured side by side: ``best`` = fastest / fastest, and the
    ``low`` / ``median`` / ``high`` of the ratios of samples taken in the same round.

    Example
    -------
    >>> str(Spread(0.5, 0.45, 0.52, 0.61))
    '0.52 [0.45-0.61]'
    """

    best: float
    low: float
    median: float
    high: float

    def __str__(self) -> str:
        return f"{_g(self.median)} [{_g(self.low)}-{_g(self.high)}]"

    def as_dict(self) -> dict:
        return {"best": self.best, "low": self.low, "median": self.median, "high": self.high}


def _g(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def safe_div(num: float, den: float) -> float:
    """``num / den``, or NaN when ``den`` is not a positive number (a time that cannot be divided by).

    >>> safe_div(1.0, 4.0), safe_div(1.0, 0.0)
    (0.25, nan)
    """
    return num / den if den > 0 else math.nan


def ratio(num: Samples, den: Samples, clock: str = "wall") -> Spread:
    """``num / den`` as a :class:`Spread` over the rounds both were sampled in (see :func:`measure`).

    Rounds with a non-positive denominator are left out of the spread; NaN
    where nothing is left.

    >>> ratio(Samples((2.0, 4.0, 3.0)), Samples((1.0, 2.0, 1.0)))
    Spread(best=2.0, low=2.0, median=2.0, high=3.0)
    """
    a, b = num.of(clock), den.of(clock)
    per_round = sorted(r for r in (safe_div(x, y) for x, y in zip(a, b)) if not math.isnan(r))
    if not per_round:
        return Spread(math.nan, math.nan, math.nan, math.nan)
    return Spread(safe_div(min(a), min(b)), per_round[0], statistics.median(per_round), per_round[-1])


def measure(
    fns: dict[str, Callable[[], object]],
    reps: int,
    *,
    group=None,
    inner: int = 1,
    warmup: int = 1,
    device: str | torch.device = "cpu",
) -> dict[str, Samples]:
    """Time every function ``reps`` times in interleaved rounds; the one timing helper of the benchmarks.

    Each sample is ``inner`` back-to-back calls divided by ``inner``. With a
    ``group`` (every rank calls ``measure`` with the same names), each
    sample starts on a barrier so the ranks start together, and is the
    slowest rank's time (per-rank times are gathered once at the end, so
    no barrier sits inside a sample). CUDA work is synchronised. A rank
    may pass a no-op for a name it takes no part in (e.g. rank 0 alone
    runs the one-rank baseline). Round i starts with function
    ``i % len(fns)``, so no function is always first.

    Returns
    -------
    dict name -> :class:`Samples` (``result``: the last return value).

    Example
    -------
    >>> import torch
    >>> from cpattn.comm.sim import SimMesh
    >>> s = measure({"x": lambda: torch.ones(8).sum()}, reps=3, group=SimMesh(1).groups()[0], inner=2)
    >>> len(s["x"].wall), s["x"].best > 0, float(s["x"].result)
    (3, True, 8.0)
    """
    import torch

    if reps < 1 or inner < 1:
        raise ValueError(f"measure: reps and inner must be >= 1; got reps={reps}, inner={inner}")
    names = list(fns)
    multi = group is not None and group.size > 1
    cuda = torch.device(device).type == "cuda"
    barrier = (lambda: group.all_reduce(torch.zeros(1, device=device))) if multi else (lambda: None)
    results = {}
    for name in names:
        for _ in range(warmup):
            results[name] = fns[name]()
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for i in range(reps):
        for name in names[i % len(names):] + names[: i % len(names)]:
            barrier()
            if cuda:
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                results[name] = fns[name]()
            if cuda:
                torch.cuda.synchronize()
            wall[name].append((time.perf_counter() - t0) / inner)
            cpu[name].append((time.process_time() - c0) / inner)
    if multi:  # every sample becomes the slowest rank's
        mine = torch.tensor([[wall[n], cpu[n]] for n in names], dtype=torch.float64, device=device)
        every = group.all_gather(mine[None]).amax(0).cpu()
        for j, n in enumerate(names):
            wall[n], cpu[n] = every[j, 0].tolist(), every[j, 1].tolist()
    return {n: Samples(tuple(wall[n]), tuple(cpu[n]), results.get(n)) for n in names}


def time_ranks(group, fn: Callable[[], object], reps: int, warmup: int = 0) -> tuple[float, object]:
    """Median seconds of ``fn()`` over ``reps`` runs, the ranks starting together; (seconds, last result).

    The slowest rank's time (:func:`measure` with one function).

    Example
    -------
    >>> sec, out = time_ranks(None, lambda: 3, reps=2)
    >>> sec > 0, out
    (True, 3)
    """
    s = measure({"fn": fn}, reps, group=group, warmup=warmup)["fn"]
    return s.median, s.result


def back_to_back(group, device="cpu", inner: int = 5) -> Callable[[Callable[[], object]], float]:
    """``once(fn)``: seconds per call of ``fn`` over ``inner`` back-to-back calls between two barriers.

    For steps that run back to back (decode steps, collectives). The
    closing barrier makes the time the slowest rank's; its cost (one small
    collective per ``inner`` calls) stays in the sample, so the result is
    always > 0. Prefer :func:`measure`, which keeps barriers out of samples.

    Example
    -------
    >>> from cpattn.comm.sim import SimMesh
    >>> once = back_to_back(SimMesh(1).groups()[0])
    >>> once(lambda: sum(range(1000))) > 0.0
    True
    """
    import torch

    sync = (lambda: group.all_reduce(torch.zeros(1, device=device))) if group.size > 1 else (lambda: None)
    cuda = torch.device(device).type == "cuda"

    def once(fn):
        sync()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if cuda:
            torch.cuda.synchronize()
        sync()
        return (time.perf_counter() - t0) / inner

    return once


class Progress:
    """Progress on stderr: a one-line bar ``[#####-----] 3/6 ring`` when stderr is a terminal.

    When stderr is not a terminal (a log, a pipe, CI), :meth:`step` prints
    nothing and :meth:`note` one line, so logs get a line per phase at most.

    Example
    -------
    >>> import io
    >>> log = io.StringIO()
    >>> bar = Progress(2, stream=log)
    >>> bar.step("one"); bar.note("compiling (first run only)"); bar.step("two")
    >>> log.getvalue()
    'compiling (first run only)\\n'
    """

    def __init__(self, total: int, width: int = 24, enabled: bool = True, stream=None):
        self.total, self.done, self.width, self.enabled = total, 0, width, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._open = False  # a bar line without its newline yet

    def step(self, label: str) -> None:
        self.done += 1
        if not (self.enabled and self.tty):
            return
        filled = self.width * min(self.done, self.total) // max(self.total, 1)
        end = "\n" if self.done >= self.total else ""
        self.stream.write(f"\r[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} {label:<40}{end}")
        self.stream.flush()
        self._open = not end

    def note(self, message: str) -> None:
        """One line of news (a phase starting, why it takes long), on a line of its own."""
        if not self.enabled:
            return
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(message + "\n")
        self.stream.flush()


