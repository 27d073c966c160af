"""Exact work and traffic counts, and the alpha + beta cost of each collective algorithm.

Attention pairs are counted exactly (bottom-right aligned causal masks, as
the kernels apply them); a query-key pair costs ``2 * Dqk`` FLOPs for the
scores and ``2 * Dv`` for the values. Collectives are priced for the
algorithm the code runs:

================  ==========================================  =====================================
collective        ring (NCCL / HCCL, and gloo's native)        one all-to-all (cpattn on gloo)
================  ==========================================  =====================================
all_gather(m)     (n-1) alpha + (n-1) m / beta                 alpha + (n-1) m / beta
reduce_scatter(M) (n-1) alpha + (n-1)/n M / beta               alpha + (n-1)/n M / beta
all_reduce(M)     2(n-1) alpha + 2(n-1)/n M / beta             alpha + (n-1) M / beta (one shot)
all_to_all(M)     (n-1) alpha + (n-1)/n M / beta               alpha + (n-1)/n M / beta
ring exchange(m)  alpha + m / beta                             (same)
================  ==========================================  =====================================

``m``: one rank's input; ``M``: the whole tensor each rank holds.

Example
-------
>>> causal_pairs(4, 4), causal_pairs(2, 4), causal_pairs(4, 4, causal=False)
(10, 7, 16)
>>> from cpattn.plan.profiles import Link
>>> round(collective_time("all_gather", 1e6, 4, Link(1e-5, 1e9), "ring") * 1e3, 3)  # 3 steps + 3 MB
3.03
"""

from __future__ import annotations

from cpattn.plan.profiles import LEGACY_ATTN_TOKENS, Link

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "ring")


def causal_pairs(lq: int, lk: int, causal: bool = True) -> int:
    """Query-key pairs a block computes: ``lq * lk`` unmasked; causal bottom-right aligned (query i of lq
    sees keys ``0 .. lk - lq + i``): ``lq * (lk - lq) + lq (lq + 1) / 2``."""
    if not causal:
        return lq * lk
    if lq > lk:
        return lk * (lk + 1) // 2
    return lq * (lk - lq) + lq * (lq + 1) // 2


def flash_tile_pairs(lq: int, lk: int, causal: bool = True, kv_split: int = 512) -> int:
    """Query-key pairs aten's CPU flash kernel computes for one ``attention_with_lse`` block, masked ones included.

    ``attention_with_lse`` runs a causal block as a square ``lq x lq`` causal diagonal (aten's
    ``_scaled_dot_product_flash_attention_for_cpu``) plus an unmasked ``lq x (lk - lq)`` prefix. The
    CPU kernel tiles queries in ``q_split`` rows (256 from 768 queries on, 64 from 192, else 32) and
    keys in ``kv_split`` (512); for a causal tile of queries ``m .. m + q_split - 1`` it visits keys
    ``0 .. m + q_split - 1`` in whole key tiles, so the last tile of every row block is computed in
    full and masked. The waste shrinks with length: 1.50x the exact pairs at 1024 tokens, 1.25x at
    2048, 1.125x at 4096, 1.06x at 8192. Unmasked blocks compute exactly ``lq * lk``.

    >>> flash_tile_pairs(2048, 2048) / causal_pairs(2048, 2048)  # doctest: +ELLIPSIS
    1.249...
    >>> flash_tile_pairs(8, 8), causal_pairs(8, 8), flash_tile_pairs(4, 6, causal=False)
    (64, 36, 24)
    """
    if not causal:
        return lq * lk
    if lq > lk:  # rows that precede every key are skipped; the visible ones form an lk x lk diagonal
        lq = lk
    n = lq  # the diagonal block is n x n
    q_split = 256 if n >= 768 else 64 if n >= 192 else 32
    q_split, ks = min(q_split, n), min(kv_split, n)
    diag = 0
    for m in range(0, n, q_split):
        rows = min(q_split, n - m)
        keys = min(m + rows, n)
        diag += rows * min(n, -(-keys // ks) * ks)
    return diag + lq * (lk - lq)


def legacy_pair_factor(kind: str) -> float:
    """Computed pairs per exact pair of attention ``kind`` at :data:`~cpattn.plan.profiles.LEGACY_ATTN_TOKENS`
    (causal kinds: the flash kernel's masked tiles; others: 1): what converts ``efficiency[kind]``, a rate per
    exact pair there, to and from a rate per computed pair.

    >>> legacy_pair_factor("attention_causal"), legacy_pair_factor("attention")  # doctest: +ELLIPSIS
    (1.249..., 1.0)
    """
    n = LEGACY_ATTN_TOKENS
    return flash_tile_pairs(n, n) / causal_pairs(n, n) if "causal" in kind else 1.0


def attention_flops(pairs: int, heads: int, dqk: int, dv: int) -> float:
    """FLOPs of ``pairs`` query-key pairs per head: scores ``2 Dqk`` plus weighted values ``2 Dv``."""
    return 2.0 * pairs * heads * (dqk + dv)


def collective_time(kind: str, nbytes: float, n: int, link: Link, algorithm: str = "ring") -> float:
    """Seconds of one collective over ``n`` ranks (table in the module doc); 0 for one rank.

    nbytes: ``m`` (one rank's input) for all_gather and ring; ``M`` (the tensor each rank holds)
    for reduce_scatter, all_reduce and all_to_all. algorithm: "ring" or "a2a".
    """
    if n <= 1:
        return 0.0
    if kind == "ring":
        return link.time(nbytes)
    a2a = algorithm == "a2a"
    if kind == "all_gather":
        return link.time((n - 1) * nbytes, 1 if a2a else n - 1)
    if kind in ("reduce_scatter", "all_to_all"):
        return link.time((n - 1) / n * nbytes, 1 if a2a else n - 1)
    if kind == "all_reduce":
        return link.time((n - 1) * nbytes, 1) if a2a else link.time(2 * (n - 1) / n * nbytes, 2 * (n - 1))
    raise ValueError(f"unknown collective {kind!r}; one of {COLLECTIVES}")


def expected_experts(experts: int, draws: int) -> float:
    """Distinct experts hit by ``draws`` independent uniform picks (tokens x top-k): ``E (1 - (1 - 1/E)^draws)``.

    >>> round(expected_experts(256, 8), 2), round(expected_experts(256, 100_000))
    (7.89, 256)
    """
    if experts == 0:
        return 0.0
    return experts * (1.0 - (1.0 - 1.0 / experts) ** draws)


def ep_all_to_all_time(nbytes: float, ep: int, devices_per_node: int, intra: Link, inter: Link) -> float:
    """One expert-parallel all-to-all (dispatch or combine) of ``nbytes`` per device over ``ep`` devices.

    Destinations are uniform: ``(min(ep, node) - 1) / ep`` of the bytes stay inside the node, ``(ep - node) / ep``
    cross nodes; both fabrics run at once, the slower one sets the time.

    >>> from cpattn.plan.profiles import Link
    >>> round(ep_all_to_all_time(1e9, 16, 8, Link(0, 1e11), Link(0, 1e10)) * 1e3, 1)  # half the bytes leave the node
    50.0
    """
    if ep <= 1:
        return 0.0
    local = min(ep, devices_per_node)
    t_in = nbytes * (local - 1) / ep / intra.beta
    t_out = nbytes * (ep - local) / ep / inter.beta if ep > local else 0.0
    return (inter.alpha if ep > local else intra.alpha) + max(t_in, t_out)
