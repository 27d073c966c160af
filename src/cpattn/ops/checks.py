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

from __future__ import annotations

import numbers

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


# ----------------------------------------------------------------------------- Python ints
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


# ----------------------------------------------------------------------------- tensors
def _is_int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


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


def paged_rows(block_table: torch.Tensor, req_indices: torch.Tensor, kv_lens: torch.Tensor, *,
               num_blocks: int, block_size: int) -> None:
    """Paged-attention row metadata: requests exist, lengths fit the table, every read block is in the cache.

    Rules: ``req_indices[t] < B`` (negative: a padding row);
    ``0 <= kv_lens[t] <= max_blocks * block_size``; and the blocks a real row
    reads, ``block_table[req, :ceil(kv_lens[t] / block_size)]``, are ids in
    ``0 .. num_blocks-1`` (entries past them are never read and may hold
    anything). Valid input costs two host reads of a few min/max values.
    """
    t = req_indices.shape[0]
    if t == 0 or not values_checkable(block_table, req_indices, kv_lens):
        return
    b, w = block_table.shape
    reach = w * block_size
    _, r_hi, l_lo, l_hi = _extremes(req_indices, kv_lens)
    if r_hi < b and l_lo >= 0 and l_hi <= reach:
        cols = -(-l_hi // block_size)  # no row reads past this column
        if b == 0 or cols == 0 or r_hi < 0:
            return
        table = block_table[:, :cols]
        b_lo, b_hi = _extremes(table)
        if b_lo >= 0 and b_hi < num_blocks:
            return  # the common case: every entry any row could read is a block of the cache
        # a short request may leave unused entries (-1 or anything) in that range: what each one reads
        longest = torch.zeros(b, dtype=torch.int64, device=kv_lens.device).scatter_reduce_(
            0, req_indices.clamp(min=0).long(), torch.where(req_indices >= 0, kv_lens.long(), 0), "amax"
        )  # [B] keys of each request's longest row
        read = torch.arange(cols, device=kv_lens.device) * block_size < longest[:, None]  # [B, cols]
        if not bool((read & ((table < 0) | (table >= num_blocks))).any()):
            return
    _paged_error(block_table, req_indices, kv_lens, num_blocks=num_blocks, block_size=block_size)


def _paged_error(block_table, req_indices, kv_lens, *, num_blocks, block_size) -> None:
    """Raise the ValueError of :func:`paged_rows` for its first offending query row."""
    b, w = block_table.shape
    reach = w * block_size
    live = req_indices >= 0  # [T]
    bad = (req_indices >= b) | (kv_lens < 0) | (kv_lens > reach)  # [T]
    if b > 0 and w > 0:
        n_blk = torch.div(kv_lens + (block_size - 1), block_size, rounding_mode="floor")  # [T]
        needed = (torch.arange(w, device=kv_lens.device) < n_blk[:, None]) & live[:, None]  # [T, W]
        ids = block_table[req_indices.clamp(0, b - 1)]  # [T, W]
        bad = bad | (needed & ((ids < 0) | (ids >= num_blocks))).any(dim=1)
    r = _where(bad)[0]
    req, n = int(req_indices[r]), int(kv_lens[r])
    if req >= b:
        raise ValueError(
            f"req_indices[{r}] = {req}; expected a row of block_table (0..{b - 1}) or a negative value for a "
            "padding row"
        )
    if n < 0:
        raise ValueError(f"kv_lens[{r}] = {n}; expected a key count >= 0 (0 for a row that sees nothing)")
    if n > reach:
        raise ValueError(
            f"kv_lens[{r}] = {n} keys, but a block_table row addresses only {w} blocks x {block_size} = {reach}; "
            "widen the block table"
        )
    row = block_table[req].tolist()
    need = -(-n // block_size)
    col = next(j for j in range(need) if not 0 <= row[j] < num_blocks)
    seen = (f"block_table[{req}, {col}] = {row[col]} is read by query row {r} "
            f"(kv_lens[{r}] = {n} keys need {need} block{'s' * (need != 1)})")
    if row[col] < 0:
        raise ValueError(f"{seen}: a -1 block inside the visible keys; give every visible key a block")
    raise ValueError(
        f"{seen} but the cache has blocks 0..{num_blocks - 1}; the block table must hold block ids of this cache"
    )


def key_ranges(key_start: torch.Tensor, visible: torch.Tensor, *, num_keys: int, max_keys: int) -> None:
    """Indexer key map: ``0 <= key_start``, ``0 <= visible <= max_keys``, ``key_start + visible <= num_keys``.

    One host read; the error names the first query breaking a rule.
    """
    if key_start.numel() == 0 or not values_checkable(key_start, visible):
        return
    end = key_start.long() + visible.long()
    bad = (key_start < 0) | (visible < 0) | (visible > max_keys) | (end > num_keys)
    if not bool(bad.any()):
        return
    t = _where(bad)[0]
    s, v = int(key_start[t]), int(visible[t])
    raise ValueError(
        f"query {t}: key_start[{t}] = {s}, visible[{t}] = {v}; expected 0 <= key_start, 0 <= visible <= "
        f"max_keys = {max_keys} and key_start + visible <= {num_keys} (rows of k). Fix the key map "
        "(causal_key_ranges builds it from cu_seqlens)"
    )
