"""Deprecated path (one minor release): the CPU profile's calibration (``cpattn plan calibrate``) moved to
:mod:`cpattn.bench.perf.calibrate`.

The planner's model (profiles, specs, costs, model) is the library; calibration, validation and anchor
fitting are benchmark-side experiments and live beside the other benchmarks in :mod:`cpattn.bench.perf`.
Every name of the old module is still reachable here (importing this module warns once).
"""

import warnings

from cpattn.bench.perf import calibrate as _0

warnings.warn("cpattn.plan.calibrate is deprecated and will be removed in the next minor release; import "
              "cpattn.bench.perf.calibrate instead",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    if hasattr(_0, name):
        return getattr(_0, name)
    raise AttributeError(f"module 'cpattn.plan.calibrate' has no attribute {name!r} (it moved to "
                         f"cpattn.bench.perf.calibrate)")
