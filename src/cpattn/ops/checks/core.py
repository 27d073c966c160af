"""When a check may read tensor values (:func:`values_checkable`), one device for every tensor, finiteness."""

from __future__ import annotations

import torch

_CUDA = torch.cuda.is_available()


def values_checkable(*xs: torch.Tensor) -> bool:
    """False while torch.compile traces or a CUDA stream captures, or when one of ``xs`` is a meta tensor
    (it has no values): no host reads of tensor values then.

    Example
    -------
    >>> values_checkable(), values_checkable(torch.empty(2, device="meta"))
    (True, False)
    """
    if torch.compiler.is_compiling():
        return False
    if any(isinstance(x, torch.Tensor) and x.is_meta for x in xs):
        return False
    return not (_CUDA and torch.cuda.is_current_stream_capturing())


def same_device(anchor_name: str, anchor: torch.Tensor, /, **tensors: torch.Tensor | None) -> None:
    """Every tensor in ``tensors`` (None skipped) on ``anchor``'s device; metadata only, so it runs traced too.

    Example
    -------
    >>> same_device("q", torch.zeros(1, device="meta"), k=torch.zeros(1), v=None)
    Traceback (most recent call last):
    ...
    ValueError: k is on cpu but q is on meta; pass every tensor argument on one device (k.to(q.device))
    """
    dev = anchor.device
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and x.device != dev:
            raise ValueError(
                f"{name} is on {x.device} but {anchor_name} is on {dev}; pass every tensor argument on one device "
                f"({name}.to({anchor_name}.device))"
            )


def all_finite(*xs: torch.Tensor) -> bool:
    """True when every element of every tensor is finite (one host read); kernels use it to pick an exact path.

    Example
    -------
    >>> all_finite(torch.ones(2), torch.tensor([1.0, float("nan")]))
    False
    """
    return bool(torch.stack([torch.isfinite(x).all() for x in xs]).all())

