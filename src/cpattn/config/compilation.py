"""``CompilationConfig``: graph capture of decode steps (vLLM's ``CompilationConfig``).

``graph_mode`` takes vLLM's ``cudagraph_mode`` names; cpattn captures
FULL_DECODE_ONLY (uniform decode batches) and runs everything else eagerly.
``capture_sizes`` are batch sizes in query tokens (vLLM's
``cudagraph_capture_sizes``; None: the defaults of
:func:`cpattn.graphs.capture_sizes`); ``graph_backend`` names a
:mod:`cpattn.graphs.backends` backend ("auto": by device).

Example
-------
>>> CompilationConfig(graph_mode="full_decode_only").captures
True
"""

from __future__ import annotations

from dataclasses import dataclass

from cpattn.config.problems import Checked, is_int, normalize, one_of, problem

GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass(frozen=True)
class CompilationConfig(Checked):
    """graph_mode, capture_sizes, graph_backend (see module doc)."""

    graph_mode: str = "NONE"
    capture_sizes: tuple[int, ...] | None = None
    graph_backend: str = "auto"

    def _normalize(self) -> None:
        normalize(self, {"graph_mode": str.upper})
        if self.capture_sizes is not None and not isinstance(self.capture_sizes, tuple):
            object.__setattr__(self, "capture_sizes", tuple(self.capture_sizes))

    @property
    def captures(self) -> bool:
        """True when uniform decode steps are captured (any mode but NONE)."""
        return self.graph_mode != "NONE"

    def field_problems(self) -> list[str]:
        out = one_of(self, {"graph_mode": GRAPH_MODES})
        sizes = self.capture_sizes
        if sizes is not None and (not sizes or not all(is_int(s) and s >= 1 for s in sizes)):
            out.append(problem("capture_sizes", repr(sizes), "a non-empty list of positive ints",
                               "pass sizes like 1,2,4,8 or leave capture_sizes unset for the defaults"))
        if not isinstance(self.graph_backend, str) or not self.graph_backend:
            out.append(problem("graph_backend", repr(self.graph_backend), "a backend name",
                               "pass one of cpattn.graphs.backends() or 'auto'"))
        return out
