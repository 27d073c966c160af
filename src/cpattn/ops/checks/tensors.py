"""Checks of integer tensors: dtype and shape, ``cu_seqlens``, value ranges, distinct ids, cache-write slots.

Value checks are vectorized (a few tensor ops and one host read per
argument) and skipped where a sync is not allowed (:func:`~cpattn.ops.checks.values_checkable`).
"""

from __future__ import annotations

import torch

from cpattn.ops.checks.core import values_checkable
from cpattn.ops.checks.ints import _is_int_dtype, cumulative


def int_tensor(name: str, x, shape: tuple | None = None, *, dims: int | None = None, desc: str = "") -> None:
    """An integer (not bool) tensor, of ``shape`` / ``dims`` when given; ``desc`` spells the expected shape.

    Example
    -------
    >>> int_tensor("kv_lens", torch.tensor([1.0]), (1,), desc="[T=1]")
    Traceback (most recent call last):
    ...
    ValueError: kv_lens must be an integer tensor [T=1]; got torch.float32 (1,)
    """
    ok = isinstance(x, torch.Tensor) and _is_int_dtype(x.dtype)
    ok = ok and (shape is None or tuple(x.shape) == tuple(shape)) and (dims is None or x.dim() == dims)
    if not ok:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be an integer tensor {desc}".rstrip() + f"; got {got}")


def cu_seqlens(name: str, cu: torch.Tensor, *, total: int | None = None, of: str = "", exact: bool = False,
               start_zero: bool = True, check_values: bool = True) -> None:
    """A ``[B+1]`` int32/int64 cu_seqlens tensor; its values (one host read) unless tracing or capturing.

    Example
    -------
    >>> cu_seqlens("cu_seqlens_q", torch.tensor([0, 3, 9]), total=4, of="q has 4 tokens")
    Traceback (most recent call last):
    ...
    ValueError: cu_seqlens_q ends at 9 but q has 4 tokens; its last entry must be at most 4
    """
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
        got = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name} must be 1-D [B+1]; got shape {got}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64; got {cu.dtype}")
    if check_values and values_checkable(cu):
        cumulative(name, cu.tolist(), total=total, of=of, exact=exact, start_zero=start_zero)


def _extremes(*xs: torch.Tensor) -> list[int]:
    """[min, max] of each tensor: the cheap test that lets valid input pass (one host read off the CPU)."""
    vals = [v for x in xs for v in torch.aminmax(x)]
    if xs[0].device.type == "cpu":
        return [int(v) for v in vals]
    return torch.stack([v.long() for v in vals]).tolist()


def _where(bad: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True of ``bad`` in row-major order (host read)."""
    return tuple(int(i) for i in bad.nonzero()[0])


def _at(name: str, idx: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(map(str, idx))}]"


def within(name: str, x: torch.Tensor, low: int, high: int | None, *, expected: str, fix: str = "",
           where: torch.Tensor | None = None) -> None:
    """Every entry of ``x`` (where ``where`` holds) in ``low .. high-1`` (no upper bound for None); one host read.

    The error shows the first offending entry, ``expected`` states the rule
    and ``fix`` how to meet it. Skipped while tracing / capturing.

    Example
    -------
    >>> within("indices", torch.tensor([[0, 7]]), -1, 5, expected="-1 or a row in 0..4")
    Traceback (most recent call last):
    ...
    ValueError: indices[0, 1] = 7; expected -1 or a row in 0..4
    """
    if x.numel() == 0 or not values_checkable(x, where):
        return
    lo, hi = _extremes(x if where is None else torch.where(where, x, low))
    if lo >= low and (high is None or hi < high):
        return
    bad = x < low if high is None else (x < low) | (x >= high)
    if where is not None:
        bad &= where
    idx = _where(bad)
    raise ValueError(f"{_at(name, idx)} = {int(x[idx])}; expected {expected}" + (f". {fix}" if fix else ""))


def distinct(name: str, x: torch.Tensor, *, expected: str, fix: str = "", low: int | None = None,
             high: int | None = None, range_expected: str = "", range_fix: str = "") -> None:
    """No entry ``>= 0`` repeats within a row of ``x`` ([T], or [T, K] row by row); negatives (padding) may.

    With ``low`` / ``high`` every entry must also lie in ``low .. high-1``
    (the error of :func:`within`, with ``range_expected`` / ``range_fix``).
    Vectorized: one sort along the last dim (it gives the extremes too), an
    adjacent compare and one host read, whatever T and K are. The error
    names the first repeat (in reading order) and the entry it repeats.
    Skipped while tracing / capturing.

    Example
    -------
    >>> distinct("slot_mapping", torch.tensor([4, -1, 7, -1, 4]), expected="distinct slots")
    Traceback (most recent call last):
    ...
    ValueError: slot_mapping[4] = 4 repeats slot_mapping[0]; expected distinct slots
    """
    if x.dim() == 0 or x.numel() == 0 or not values_checkable(x):
        return
    rows = x.reshape(-1, x.shape[-1])  # [R, n]
    s, order = torch.sort(rows, dim=-1, stable=True)  # equal values end up adjacent, in their original order
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)  # [R, n-1]
    facts = torch.stack([s[:, 0].min().long(), s[:, -1].max().long(), dup.any().long()])
    lo, hi, repeats = facts.tolist()  # the one host read of valid input
    if (low is not None and lo < low) or (high is not None and hi >= high):
        within(name, x, -(2**63) if low is None else low, high, expected=range_expected, fix=range_fix)
    if not repeats:
        return
    r = _where(dup.any(dim=1))[0]  # the first row holding a repeat
    n = rows.shape[1]
    later = torch.where(dup[r], order[r, 1:], n)  # original position of each repeat
    k = int(later.argmin())
    i, j = int(later[k]), int(order[r, k])  # the repeat and the entry just before it in sorted order
    at = (lambda c: f"{name}[{c}]") if x.dim() == 1 else (lambda c: _at(name, (*_unravel(r, x.shape[:-1]), c)))
    raise ValueError(f"{at(i)} = {int(rows[r, i])} repeats {at(j)}; expected {expected}" + (f". {fix}" if fix else ""))


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def slots(name: str, slot_mapping: torch.Tensor, t: int, cache_name: str, cache: torch.Tensor, *,
          row: str = "KV") -> None:
    """A cache write's ``slot_mapping``: int32/int64 [T]; each entry -1 (skip) or a slot of ``cache``, valid
    slots distinct (two tokens in one slot would lose one token's ``row``). Skipped while tracing / capturing.

    Example
    -------
    >>> cache = torch.zeros(2, 4, 1, 8)
    >>> slots("slot_mapping", torch.tensor([5, -1, -1, 5]), 4, "kv_cache", cache)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: slot_mapping[3] = 5 repeats slot_mapping[0]; expected distinct slots, one per written token ...
    """
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.shape != (t,) or slot_mapping.dtype not in (
        torch.int32, torch.int64
    ):
        got = (f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}" if isinstance(slot_mapping, torch.Tensor)
               else type(slot_mapping).__name__)
        raise ValueError(f"{name} must be int32/int64 [T={t}]; got {got}")
    nb, bs = cache.shape[:2]
    distinct(name, slot_mapping, low=-1, high=nb * bs,
             range_expected=f"-1 (skip the token) or a slot in 0..{nb * bs - 1} ({cache_name} has {nb} blocks x {bs})",
             range_fix="A slot is block_id * block_size + offset, with block ids of this cache",
             expected=f"distinct slots, one per written token (-1 may repeat): two tokens in one slot lose one "
                      f"token's {row}",
             fix="Give each token its own slot, or -1 to skip it")
