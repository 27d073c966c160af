"""What long training work is doing, and when its budget ends: phases and steps on stderr.

``cpattn train-target`` / ``cpattn train-draft`` report through one
:class:`Phases`: a tqdm bar when stderr is a terminal, otherwise one line
per phase (``"train-draft: generating data: ..."``) and a training line every
few seconds (step, loss, time used of the budget), so a log shows what is
happening without a bar's carriage returns. :class:`Budget` is the one
wall-clock deadline the phases share.

Example
-------
>>> import io
>>> log = io.StringIO()
>>> ph = Phases("demo", stream=log)
>>> ph.phase("generating data", "4 prompts x 8 tokens")
>>> ph.step(1, 0.5); ph.done("1 step")
>>> print(log.getvalue().strip())
demo: generating data: 4 prompts x 8 tokens
demo: generating data done: 1 step
"""

from __future__ import annotations

import sys
import time


class Budget:
    """A wall-clock budget of ``seconds`` from construction (None: unbounded).

    >>> b = Budget(None)
    >>> b.left(), b.spent_fraction()
    (inf, 0.0)
    """

    def __init__(self, seconds: float | None):
        self.seconds, self.t0 = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        """Seconds left (inf without a budget)."""
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def spent_fraction(self) -> float:
        return 0.0 if not self.seconds else self.elapsed() / self.seconds

    @property
    def deadline(self) -> float | None:
        """The ``time.perf_counter()`` value the budget ends at (None: unbounded)."""
        return None if self.seconds is None else self.t0 + self.seconds


class Phases:
    """Progress of one command on ``stream`` (default stderr): :meth:`phase` starts a phase, :meth:`step`
    reports a training step, :meth:`done` ends the step phase. ``enabled=False``: silent."""

    def __init__(self, prog: str, *, stream=None, enabled: bool = True, every: float = 2.0):
        self.prog, self.enabled, self.every = prog, enabled, every
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar, self._last, self._total, self._label = None, 0.0, None, ""

    def _line(self, text: str) -> None:
        if self.enabled:
            self.stream.write(f"{self.prog}: {text}\n")
            self.stream.flush()

    def phase(self, name: str, detail: str = "", *, total: int | None = None, budget: float | None = None) -> None:
        """A phase starts (closing a bar still open); ``total`` steps or ``budget`` seconds set the bar."""
        self._close()
        self._line(f"{name}: {detail}" if detail else name)
        self._total, self._label, self._last = total, name, time.perf_counter()
        self._budget = budget
        if self.enabled and self.tty:
            try:
                from tqdm import tqdm
            except ImportError:  # no tqdm: lines only
                return
            self._bar = tqdm(total=total, desc=f"{self.prog}: {name}", file=self.stream, leave=False,
                             unit="step")

    def step(self, step: int, loss: float | None = None, *, elapsed: float | None = None) -> None:
        """Step ``step`` finished with ``loss``: the bar moves, or a line every ``every`` seconds."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            return
        now = time.perf_counter()
        if now - self._last >= self.every:
            self._last = now
            of = f" of {self._total}" if self._total else ""
            t = "" if elapsed is None else f", {elapsed:.1f} s" + (f" of {self._budget:g} s" if self._budget else "")
            self._line(f"{self._label}: step {step}{of}" + ("" if loss is None else f", loss {loss:.4f}") + t)

    def done(self, detail: str) -> None:
        """The current phase ended (``detail``: what it did)."""
        self._close()
        self._line(f"{self._label} done: {detail}")

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
