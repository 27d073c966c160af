"""Argument checks shared by every public op and primitive.

Each check raises :class:`ValueError` naming the argument, what was seen
(the first offending position and value, never a dump of the tensor), the
rule, and how to fix it (DESIGN.md §3).

Checks of shapes, dtypes and devices (:func:`same_device`) always run:
they read metadata only. Checks that read tensor *values* (ranges,
:func:`distinct` ids) sync with the host, so they are skipped where a sync
is not allowed: while torch.compile traces and while a CUDA stream is
captured, and on meta tensors, which hold none (:func:`values_checkable`);
there the plan step that built the tensors is the place that validates them. Value checks are vectorized: a few tensor ops
and one host read per argument, whatever the batch size.

Example
-------
>>> import torch
>>> cumulative("cu_seqlens", [0, 5, 2])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: cu_seqlens must be non-decreasing (...); got cu_seqlens[1] = 5 > cu_seqlens[2] = 2. Pass ...
"""

from cpattn.ops.checks.core import all_finite, same_device, values_checkable
from cpattn.ops.checks.ints import cumulative, int_list, integer, nonnegative, rank
from cpattn.ops.checks.paged import key_ranges, paged_rows
from cpattn.ops.checks.tensors import cu_seqlens, distinct, int_tensor, slots, within

__all__ = ["all_finite", "cu_seqlens", "cumulative", "distinct", "int_list", "int_tensor", "integer", "key_ranges",
           "nonnegative", "paged_rows", "rank", "same_device", "slots", "values_checkable", "within"]
