"""Checks of host integers: sizes and ranks, integer lists, counts, cumulative ``cu_seqlens`` lists."""

from __future__ import annotations

import numbers

import torch


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def integer(name: str, value, *, at_least: int | None = None) -> int:
    """A Python integer argument (sizes, ranks); floats and bools are refused, not truncated.

    Example
    -------
    >>> integer("pcp_size", 2, at_least=1)
    2
    >>> integer("pcp_size", 2.5)
    Traceback (most recent call last):
    ...
    ValueError: pcp_size must be an integer; got 2.5 (float)
    """
    if isinstance(value, torch.Tensor) and value.dim() == 0 and _is_int_dtype(value.dtype):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")
    value = int(value)
    if at_least is not None and value < at_least:
        raise ValueError(f"{name} must be >= {at_least}; got {value}")
    return value


def rank(name: str, value, size: int, what: str) -> int:
    """A rank index: an integer in ``0 .. size-1``.

    Example
    -------
    >>> rank("rank", 2, 2, "the plan's ranks")
    Traceback (most recent call last):
    ...
    ValueError: rank must be in 0..1 (the plan's ranks: 2); got 2
    """
    value = integer(name, value)
    if not 0 <= value < size:
        raise ValueError(f"{name} must be in 0..{size - 1} ({what}: {size}); got {value}")
    return value


def int_list(name: str, values) -> list[int]:
    """Host integers from a 1-D integer tensor or a sequence of ints; floats are refused, not truncated.

    Example
    -------
    >>> int_list("seq_lens", [3, 4])
    [3, 4]
    >>> int_list("seq_lens", [3, 4.5])
    Traceback (most recent call last):
    ...
    ValueError: seq_lens must hold integers (token counts); got 4.5 (float) at index 1
    """
    if isinstance(values, torch.Tensor):
        if not _is_int_dtype(values.dtype) or values.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D integer tensor or a list of ints; got {values.dtype} {tuple(values.shape)}"
            )
        return values.tolist()
    try:
        items = None if isinstance(values, (str, bytes)) else list(values)
    except TypeError:
        items = None
    if items is None:
        raise ValueError(f"{name} must be a list of ints or a 1-D integer tensor; got {type(values).__name__}")
    out = []
    for i, v in enumerate(items):
        if isinstance(v, torch.Tensor) and v.dim() == 0 and _is_int_dtype(v.dtype):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{name} must hold integers (token counts); got {v!r} ({type(v).__name__}) at index {i}")
        out.append(int(v))
    return out


def nonnegative(name: str, values: list[int], length: int | None = None, what: str = "") -> None:
    """Every entry >= 0 (and ``length`` entries when given).

    Example
    -------
    >>> nonnegative("context_lens", [3, -1], 2, "one per request")
    Traceback (most recent call last):
    ...
    ValueError: context_lens[1] = -1; expected a count >= 0
    """
    if length is not None and len(values) != length:
        raise ValueError(f"{name} must hold {length} entries ({what}); got {len(values)}")
    for i, v in enumerate(values):
        if v < 0:
            raise ValueError(f"{name}[{i}] = {v}; expected a count >= 0")


def cumulative(name: str, cu: list[int], *, total: int | None = None, of: str = "", exact: bool = False,
               start_zero: bool = True) -> None:
    """The ``cu_seqlens`` rule on host ints: ``[B+1]``, first entry 0 (or >= 0), non-decreasing, end within ``total``.

    ``of`` names what ``total`` counts (e.g. "q has 7 tokens"); ``exact``
    demands ``cu[-1] == total`` instead of ``<=``.
    """
    if len(cu) < 1:
        raise ValueError(f"{name} must hold B+1 >= 1 entries (cumulative token counts starting at 0); got []")
    if start_zero and cu[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {cu[0]}. Pass [0, n0, n0+n1, ...]")
    if cu[0] < 0:
        raise ValueError(f"{name}[0] = {cu[0]}; token offsets must be >= 0")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing (request b holds tokens {name}[b]:{name}[b+1]); got "
                f"{name}[{i - 1}] = {cu[i - 1]} > {name}[{i}] = {cu[i]}. Pass cumulative lengths [0, n0, n0+n1, ...]"
            )
    if total is not None and (cu[-1] != total if exact else cu[-1] > total):
        rule = "must equal" if exact else "must be at most"
        raise ValueError(f"{name} ends at {cu[-1]} but {of}; its last entry {rule} {total}")

