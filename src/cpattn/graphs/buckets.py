"""Capture sizes: which padded batch sizes get their own captured decode program.

Sizes count query *tokens* (as vLLM's ``cudagraph_capture_sizes`` do). With
speculative decoding every request brings ``q_len = 1 + num_speculative_tokens``
tokens, so every size is a multiple of ``q_len`` and a size ``s`` holds
``s // q_len`` requests. A uniform decode batch of ``T`` tokens is padded up
to the smallest size ``>= T``; a batch above the largest size runs eagerly.

Default sizes: 1, 2, 4, then every multiple of 8 up to the maximum (the
maximum itself is always included). When speculating, the sizes are rounded
up to multiples of ``q_len``, plus every multiple of ``q_len`` up to
``8 * q_len`` so small batches are not padded by a whole 8-token step::

    capture_sizes(32)                           -> [1, 2, 4, 8, 16, 24, 32]
    capture_sizes(32, num_speculative_tokens=1) -> [2, 4, 6, 8, 10, 12, 14, 16, 24, 32]
    capture_sizes(24, num_speculative_tokens=2) -> [3, 6, 9, 12, 15, 18, 21, 24]
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def capture_sizes(max_size: int, num_speculative_tokens: int = 0) -> list[int]:
    """Default capture sizes (in tokens) up to ``max_size``.

    Arguments
    ---------
    max_size: the largest padded batch, in query tokens; rounded down to a
        multiple of ``q_len = 1 + num_speculative_tokens``.
    num_speculative_tokens: k draft tokens per request; every size becomes a
        multiple of ``1 + k`` (the base sizes 1, 2, 4, 8, 16, ... rounded up).

    Returns
    -------
    Sorted, distinct sizes; the largest is ``max_size`` rounded down to a
    multiple of ``q_len``.

    Example
    -------
    >>> capture_sizes(32)
    [1, 2, 4, 8, 16, 24, 32]
    >>> capture_sizes(16, num_speculative_tokens=2)
    [3, 6, 9, 12, 15]
    """
    q_len = _q_len(num_speculative_tokens)
    if max_size < q_len:
        raise ValueError(
            f"max_size = {max_size} is smaller than one request's query tokens "
            f"(1 + num_speculative_tokens = {q_len}); pass max_size >= {q_len}"
        )
    top = max_size // q_len * q_len
    base = [1, 2, 4, *range(8, top + 1, 8)]
    if q_len > 1:  # speculating: smaller steps, so padding stays below one 8-token step
        base += list(range(q_len, min(top, 8 * q_len) + 1, q_len))
    sizes = {_round_up(s, q_len) for s in base}
    return sorted(s for s in sizes | {top} if s <= top)


def check_sizes(sizes: Iterable[int], num_speculative_tokens: int = 0) -> list[int]:
    """Validate user-given capture sizes; return them sorted and distinct.

    Example
    -------
    >>> check_sizes([8, 1, 4, 4])
    [1, 4, 8]
    """
    q_len = _q_len(num_speculative_tokens)
    out = sorted(set(int(s) for s in sizes))
    if not out:
        raise ValueError("capture_sizes is empty; pass at least one size, e.g. [1, 2, 4, 8]")
    bad = [s for s in out if s <= 0 or s % q_len]
    if bad:
        raise ValueError(
            f"capture_sizes {bad} are not positive multiples of 1 + num_speculative_tokens = {q_len}; "
            f"every captured batch holds whole requests of {q_len} tokens; "
            f"use capture_sizes(max_size, num_speculative_tokens={num_speculative_tokens})"
        )
    return out


def pick_size(sizes: list[int], num_tokens: int) -> int | None:
    """The smallest capture size ``>= num_tokens`` (``sizes`` sorted), or None if too big.

    Example
    -------
    >>> pick_size([1, 2, 4, 8], 3), pick_size([1, 2, 4, 8], 9)
    (4, None)
    """
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


def _q_len(num_speculative_tokens: int) -> int:
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0; got {num_speculative_tokens}")
    return 1 + int(num_speculative_tokens)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
