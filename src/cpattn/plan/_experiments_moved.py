"""Deprecated old path of the planner's experiments: ``cpattn.plan.cli.main(["calibrate" | "validate" |
"anchors", ...])``.

They run benchmarks, so they live on the benchmark side (:func:`cpattn.bench.perf.cli.main`), and the
command line reaches them from :mod:`cpattn.cli` (``cpattn plan calibrate ...`` is unchanged). Calling
them through the planner's ``main`` warns (DeprecationWarning naming the new function) and runs it. Kept
for one release; the planner itself never imports the benchmark side.
"""

from __future__ import annotations

import importlib
import warnings


def run(argv: list[str]) -> int:
    """``cpattn.bench.perf.cli.main(argv)``, with a DeprecationWarning naming it."""
    warnings.warn(f"cpattn.plan.cli.main([{argv[0]!r}, ...]) moved to cpattn.bench.perf.cli.main; call it (or "
                  f"`cpattn plan {argv[0]}`) instead (the old path goes in the next release)", DeprecationWarning,
                  stacklevel=3)
    return importlib.import_module("cpattn.bench.perf.cli").main(argv)
