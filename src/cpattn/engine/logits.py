"""The dtype logits leave a model in: float32, or float64 for a float64 run.

A float64 run is the engine's exactness oracle (DESIGN.md §5): casting its
logits to float32 would round two float64 paths that differ in their last
bits (a prefix path sums in another order) to float32 values one ulp apart,
and every comparison after the cast would then test float32 rounding, not
the engine.

>>> as_logits(torch.zeros(2, dtype=torch.bfloat16)).dtype, as_logits(torch.zeros(2, dtype=torch.float64)).dtype
(torch.float32, torch.float64)
"""

from __future__ import annotations

import torch

from cpattn.ops.ref import acc_dtype


def as_logits(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., V] in the logits dtype (:func:`~cpattn.ops.ref.acc_dtype`): float64 stays, else float32."""
    return x.to(acc_dtype(x))


__all__ = ["acc_dtype", "as_logits"]
