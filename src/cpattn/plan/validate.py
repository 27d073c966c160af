"""Deprecated path (one minor release): the benchmarks' predictors (library) and the validation experiment
(``cpattn plan validate``) moved to :mod:`cpattn.plan.bench_model` and :mod:`cpattn.bench.perf.validate` and
:mod:`cpattn.plan.opcount`.

The planner's model (profiles, specs, costs, model) is the library; calibration, validation and anchor
fitting are benchmark-side experiments and live beside the other benchmarks in :mod:`cpattn.bench.perf`.
Every name of the old module is still reachable here (importing this module warns once).
"""

import warnings

from cpattn.plan import bench_model as _0
from cpattn.bench.perf import validate as _1
from cpattn.plan import opcount as _2

warnings.warn("cpattn.plan.validate is deprecated and will be removed in the next minor release; import "
              "cpattn.plan.bench_model / cpattn.bench.perf.validate / cpattn.plan.opcount instead",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    if hasattr(_0, name):
        return getattr(_0, name)
    if hasattr(_1, name):
        return getattr(_1, name)
    if hasattr(_2, name):
        return getattr(_2, name)
    raise AttributeError(f"module 'cpattn.plan.validate' has no attribute {name!r} (it moved to "
                         f"cpattn.plan.bench_model / cpattn.bench.perf.validate / cpattn.plan.opcount)")
