"""The skeleton every benchmark shares, held once: parser, ranks, interleaved rounds, rows, table, ``--json``.

A benchmark is its measurement; this module is the rest:

- :func:`parser`: the command line with ``--quick``, ``--json PATH|-`` and
  (where ranks run) ``--timeout``, refusing a typo before torch is imported;
- :func:`compare`: the compared variants timed in interleaved rounds (round
  i starts with variant ``i % n``: A B, B A, A B ..., never all-A then
  all-B), the order recorded; :meth:`Comparison.ratio` pairs the samples of
  one round (wall or CPU time) and never divides by a time that can be 0;
- :func:`spread` / :func:`paired`: median [low-high] of plain samples, and a
  ratio of two lists of paired samples;
- :func:`ranks`: ``spawn`` on gloo ranks of one thread, with a progress line;
- :class:`Report`: the text report (header lines, :meth:`Report.table`, the
  one table printer) on stdout, or on stderr under ``--json -`` so stdout
  carries the JSON alone; progress lines always on stderr.

Example: a whole benchmark
--------------------------
>>> def main(argv=None):
...     p = parser("cpattn bench toy", "A toy.", quick="fewer rounds")
...     args = p.parse_args(argv)
...     with Report(args) as out:
...         c = compare({"a": lambda: sum(range(300)), "b": lambda: sum(range(100))}, reps=2 if args.quick else 5)
...         rows = [{"variant": n, "ms": 1e3 * s.median} for n, s in c.samples.items()]
...         out.line(f"toy: {len(c.order)} timed calls, a / b = {c.ratio('a', 'b')}")
...         out.payload = {"rows": rows}
...     return 0
>>> import contextlib, io, json
>>> stdout = io.StringIO()
>>> with contextlib.redirect_stdout(stdout):  # the text report goes to stderr
...     rc = main(["--quick", "--json", "-"])
>>> rc, [r["variant"] for r in json.loads(stdout.getvalue())["rows"]]
(0, ['a', 'b'])
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cpattn.bench.common import Samples, Spread, measure, ratio, safe_div, table, write_json
from cpattn.config import cli_args as cli

__all__ = ["parser", "compare", "Comparison", "spread", "paired", "ranks", "Report", "table", "safe_div",
           "Samples", "Spread"]


def parser(prog: str, doc: str | None, *, quick: str, timeout: float | bool = False):
    """The benchmark's parser: ``--quick`` (``quick`` says what it shrinks), ``--json``, and ``--timeout``
    when ``timeout`` is true (a number: its default). Add the benchmark's own flags, then parse.

    >>> a = parser("cpattn bench x", None, quick="small", timeout=60.0).parse_args(["--quick"])
    >>> a.quick, a.json, a.timeout
    (True, None, 60.0)
    """
    p = cli.parser(prog, doc)
    cli.add_quick(p, quick)
    cli.add_json(p)
    if timeout is not False:
        if timeout is True:
            cli.add_timeout(p)
        else:
            cli.add_timeout(p, default=timeout)
    return p


@dataclass(frozen=True)
class Comparison:
    """The samples of variants timed side by side (:func:`compare`) and the order they ran in.

    ``order``: ``(round, name)`` of every timed call, in time order.
    """

    samples: dict[str, Samples]
    order: list[tuple[int, str]] = field(default_factory=list)

    def ratio(self, num: str, den: str, clock: str = "wall") -> Spread:
        """``num / den`` from the samples of the same round (``clock``: "wall" or "cpu"); NaN, never an
        exception, where a time is 0.

        >>> c = Comparison({"a": Samples((2.0, 4.0), (1.0, 0.0)), "b": Samples((1.0, 2.0), (1.0, 1.0))})
        >>> str(c.ratio("a", "b")), str(c.ratio("b", "a", clock="cpu"))
        ('2 [2-2]', '1 [1-1]')
        """
        return ratio(self.samples[num], self.samples[den], clock)


def compare(variants: dict[str, Callable[[], object]], reps: int, *, group=None, inner: int = 1, warmup: int = 1,
            device="cpu") -> Comparison:
    """Time every variant ``reps`` times in interleaved rounds (:func:`cpattn.bench.common.measure`: round i
    starts with variant ``i % len(variants)``; with a ``group`` every sample is the slowest rank's), and
    record the order of the timed calls.

    >>> c = compare({"A": lambda: 1, "B": lambda: 2}, reps=3, warmup=0)
    >>> [n for _, n in c.order], c.samples["B"].result
    (['A', 'B', 'B', 'A', 'A', 'B'], 2)
    """
    order: list[tuple[int, str]] = []
    calls = {n: 0 for n in variants}

    def recorded(name, fn):
        def call():
            k = calls[name] - warmup  # warmup calls come first, then `inner` calls per round
            if k >= 0 and k % inner == 0:
                order.append((k // inner, name))
            calls[name] += 1
            return fn()
        return call

    samples = measure({n: recorded(n, f) for n, f in variants.items()}, reps, group=group, inner=inner,
                      warmup=warmup, device=device)
    return Comparison(samples, order)


def spread(values) -> Spread:
    """median [low-high] of plain samples (``best`` = ``low``).

    >>> str(spread([3.0, 1.0, 2.0]))
    '2 [1-3]'
    """
    v = sorted(values)
    return Spread(v[0], v[0], statistics.median(v), v[-1])


def paired(num, den) -> Spread:
    """``num[i] / den[i]`` per round as a :class:`Spread` (``best`` = min / min); a round whose ``den`` is not
    positive is left out, NaN where none is left.

    >>> paired([2.0, 3.0, 5.0], [1.0, 1.0, 0.0]).as_dict()  # min(den) is 0: best is NaN
    {'best': nan, 'low': 2.0, 'median': 2.5, 'high': 3.0}
    """
    return ratio(Samples(tuple(num)), Samples(tuple(den)))


def ranks(n: int, fn: Callable, *args, timeout_s: float, threads: int = 1, label: str = "", **kwargs) -> list:
    """``fn(group, *args, **kwargs)`` on ``n`` gloo ranks of ``threads`` threads (:func:`cpattn.comm.launch.spawn`);
    one progress line on stderr first. Returns the per-rank results."""
    from cpattn.comm.launch import spawn

    progress(f"{n} rank{'s' if n > 1 else ''}{': ' + label if label else ''}")
    return spawn(n, fn, *args, threads=threads, timeout_s=timeout_s, **kwargs)


def progress(message: str) -> None:
    """One progress line on stderr (never on stdout, so ``--json -`` stays pure)."""
    sys.stderr.write(f"... {message}\n")
    sys.stderr.flush()


class Report:
    """The text report of one run, and its JSON. Use as a context manager::

        with Report(args) as out:      # args.json: None, a path, or "-"
            out.line("header"); out.table(rows, COLUMNS); out.payload = {...}

    Inside the block ``print`` and :meth:`line` go to stdout, or to stderr
    under ``--json -``; on a clean exit ``payload`` is written to
    ``args.json`` (stdout for ``-``: then nothing else is on it).
    ``elapsed`` is the seconds since the block began.
    """

    def __init__(self, args):
        self.json_path = getattr(args, "json", None)
        self.payload: dict = {}
        self._t0 = time.perf_counter()
        self._redirect = contextlib.ExitStack()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def __enter__(self) -> "Report":
        self._t0 = time.perf_counter()
        self._redirect.enter_context(cli.report_to(self.json_path))
        return self

    def __exit__(self, kind, value, tb) -> bool:
        self._redirect.close()
        if kind is None:
            write_json(self.json_path, self.payload)
        return False

    def line(self, text: str = "") -> None:
        """One line of the text report."""
        print(text)

    def table(self, rows: list[dict], columns: list[str]) -> None:
        """The rows as the benchmarks' one fixed-width table (:func:`cpattn.bench.common.table`)."""
        print(table(rows, columns))

    progress = staticmethod(progress)
