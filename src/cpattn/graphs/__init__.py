"""Graph-captured decode programs (FULL_DECODE_ONLY) with an eager fallback.

Uniform decode batches replay a program captured per capture size; prefill,
mixed and oversized batches call the same step eagerly, through the same
``torch.ops.cpattn.*`` ops. See docs/graphs.md and DESIGN.md §4.6.

>>> from cpattn.graphs import DecodeRunner, Field, capture_sizes
>>> capture_sizes(16)
[1, 2, 4, 8, 16]
"""

from cpattn.graphs.backends import (
    Backend, BackendUnavailable, CompileBackend, DeviceGraphBackend, EagerBackend, backends, get_backend,
    register_backend,
)
from cpattn.graphs.buckets import capture_sizes, pick_size
from cpattn.graphs.check import StaticStepError, check_static
from cpattn.graphs.runner import DecodeRunner, Field, RunnerStats

__all__ = [
    "DecodeRunner", "Field", "RunnerStats", "capture_sizes", "pick_size",
    "Backend", "BackendUnavailable", "CompileBackend", "DeviceGraphBackend", "EagerBackend",
    "backends", "get_backend", "register_backend", "check_static", "StaticStepError",
]
