"""DeepSeek-V4's attention counted exactly: keys each query attends per layer kind, and the bytes a layer holds.

Every V4 layer attends its sliding window (the last ``window`` tokens,
uncompressed); a CSA layer adds the top-``index_topk`` of its compressed
entries (one per ``csa_ratio`` tokens) chosen by an indexer that scores every
visible compressed entry; an HCA layer adds every visible compressed entry
(one per ``hca_ratio`` tokens). Query ``q`` (1-based position) sees
``q // ratio`` compressed entries. Attention is multi-query: 64 (Flash)
query heads of ``head_dim`` on one K = V head of ``head_dim``.

Example
-------
>>> compressed_pairs(0, 10, 4) == sum(q // 4 for q in range(1, 11))
True
>>> compressed_pairs(3, 20, 4, topk=2) == sum(min(q // 4, 2) for q in range(4, 21))
True
"""

from __future__ import annotations

from cpattn.plan.costs import attention_flops


def _prefix(n: int, ratio: int, topk: int | None) -> int:
    """``sum(min(q // ratio, topk) for q in 1..n)`` in closed form (no cap when ``topk`` is None)."""
    def full(m: int) -> int:  # sum(q // ratio for q in 1..m)
        j = m // ratio
        return ratio * j * (j - 1) // 2 + j * (m - j * ratio + 1)

    if topk is None or n < topk * ratio:
        return full(n)
    return full(topk * ratio - 1) + topk * (n - topk * ratio + 1)


def compressed_pairs(start: int, end: int, ratio: int, topk: int | None = None) -> int:
    """Compressed entries attended by the queries at positions ``start + 1 .. end``, each seeing
    ``q // ratio`` of them (at most ``topk``)."""
    return _prefix(end, ratio, topk) - _prefix(start, ratio, topk)


def window_pairs(new: int, cached: int, window: int) -> int:
    """Keys of the sliding window attended by ``new`` queries after ``cached`` tokens (each at most ``window``)."""
    from cpattn.plan.model import topk_pairs

    return topk_pairs(new, cached, window)


def prefill_attention_flops(spec, layer: int, new: int, cached: int) -> float:
    """One V4 layer's attention FLOPs for one request of ``new`` tokens after ``cached`` ones, all heads: the
    window, the compressed entries (CSA: top-k of them plus the indexer's scores over all; HCA: all)."""
    kind, d = spec.layer_kinds[layer], spec.head_dim
    pairs = window_pairs(new, cached, spec.window)
    extra = 0.0
    if kind == "csa":
        pairs += compressed_pairs(cached, cached + new, spec.csa_ratio, spec.index_topk)
        extra = 2.0 * compressed_pairs(cached, cached + new, spec.csa_ratio) * spec.index_heads * spec.index_dim
    elif kind == "hca":
        pairs += compressed_pairs(cached, cached + new, spec.hca_ratio)
    return attention_flops(pairs, spec.heads, d, d) + extra


def exchange_bytes(spec, layer: int, tokens: int, act: int) -> float:
    """Bytes of one PCP rank's share of ``tokens`` tokens another rank needs in one V4 layer: its compressed
    entries (and CSA's indexer keys), or for a sliding layer the window's rows at its edge."""
    kind, d = spec.layer_kinds[layer], spec.head_dim
    if kind == "sliding":
        return min(tokens, spec.window) * d * act
    ratio = spec.csa_ratio if kind == "csa" else spec.hca_ratio
    width = d + (spec.index_dim if kind == "csa" else 0)
    return (tokens / ratio) * width * act + min(tokens, spec.window) * d * act


def decode_keys(spec, layer: int, context: int, shards: int) -> tuple[float, float]:
    """(keys one device attends per request in one decode step, indexer keys it scores) of a V4 layer at
    ``context`` cached tokens, the compressed entries sharded over ``shards`` devices (the window is not)."""
    kind = spec.layer_kinds[layer]
    win = min(spec.window, context)
    if kind == "sliding":
        return float(win), 0.0
    if kind == "csa":
        visible = context / spec.csa_ratio
        return win + min(spec.index_topk, visible) / shards, visible / shards
    return win + context / spec.hca_ratio / shards, 0.0
