"""Prefill context parallel: ``pcp_prefill`` over a head-tail split (DESIGN.md §4.2).

Rank r holds chunks a = r and b = 2P-1-r of every request, laid out ``[A | B]``.

``method="ring"``: KV travels rank -> rank+1. At step s the KV of
``r' = (r - s) mod P`` is here::

    s = 0      q_A x kv_A causal,  q_B x kv_A full,  q_B x kv_B causal
    r' < r     q_A x kv_A' full,   q_B x kv_A' full          (kv_B' is in the future)
    r' > r     q_B x kv_A' full,   q_B x kv_B' full          (q_A precedes both)

Each step is ~2c^2 query-key pairs for chunk length c; the next exchange is
started before the current step computes, so transfer overlaps compute.

``method="allgather"``: one all-gather of K/V, then each local chunk attends
its causal prefix (unmasked prefix + causal diagonal, merged by LSE inside
the op). Same traffic, simpler, no overlap.

Partials are merged by LSE in float32. Cached context (prefix caching /
chunked prefill) is attended non-causally and merged the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.layout.pcp import PCPPlan
from cpattn.ops import attention_with_lse
from cpattn.ops.merge import merge_into
from cpattn.ops.attention import check_qkv
from cpattn.ops.ref import acc_dtype

METHODS = ("ring", "allgather")


@dataclass(frozen=True)
class Context:
    """Cached KV of earlier tokens, contiguous and replicated on every rank.

    k: [Tc, Hkv, Dqk]; v: [Tc, Hkv, Dv]; cu_seqlens: [B+1] -- request b's
    cached keys are ``k[cu_seqlens[b]:cu_seqlens[b+1]]``; every new token of
    request b sees all of them.
    """

    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor

    def attend(self, q, cu_q, scale, group):
        """Partial attention of q [Tq, Hq, D] (requests by cu_q) over the context."""
        return attention_with_lse(q, self.k, self.v, cu_q, self.cu_seqlens, causal=False, softmax_scale=scale)


class _Acc:
    """Running LSE merge of partials over rows [T, H, Dv], in float32 (float64 for float64 input).

    The first partial of a row range is copied in; later ones are merged in
    place (``merge_into``).
    """

    def __init__(self, t, h, dv, like: torch.Tensor):
        dtype = acc_dtype(like.dtype)
        self.out = torch.zeros(t, h, dv, dtype=dtype, device=like.device)
        self.lse = torch.full((t, h), float("-inf"), dtype=dtype, device=like.device)
        self.filled: set[tuple[int, int]] = set()

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        if out.shape[0] == 0:
            return
        key = (rows.start, rows.stop)
        if key in self.filled:
            merge_into(self.out[rows], self.lse[rows], out, lse)
        else:
            self.out[rows] = out
            self.lse[rows] = lse
            self.filled.add(key)


def pcp_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: PCPPlan,
    *,
    group: Group,
    method: str = "ring",
    context: Context | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """Causal prefill attention with the sequence split over a PCP group.

    Arguments
    ---------
    q: [T_r, Hq, Dqk]; k: [T_r, Hkv, Dqk]; v: [T_r, Hkv, Dv] -- this rank's
        tokens, ``pcp_shard(x, plan, group.rank)`` of the packed batch.
    plan: from ``pcp_plan(cu_seqlens, group.size, context_lens=...)``.
    group: the PCP group (simulated or torch.distributed).
    method: "ring" (KV passed around, overlapped) or "allgather".
    context: cached earlier tokens (a :class:`Context`, or any object with
        the same ``attend`` method, e.g. a DCP-sharded paged cache).
    softmax_scale: defaults to ``Dqk ** -0.5``.

    Returns
    -------
    out: [T_r, Hq, Dv] in q's dtype, this rank's tokens (``pcp_unshard``
    restores request order); with ``return_lse`` also lse [T_r, Hq] float32
    (float64 for float64 inputs).

    Example
    -------
    >>> import torch, cpattn
    >>> from cpattn import pcp_plan, pcp_shard, pcp_prefill
    >>> q, k, v = torch.randn(10, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    >>> plan = pcp_plan([0, 6, 10], 2)
    >>> def rank_fn(g):
    ...     s = lambda x: pcp_shard(x, plan, g.rank)
    ...     return pcp_prefill(s(q), s(k), s(v), plan, group=g)
    >>> out = cpattn.pcp_unshard(cpattn.simulate(2, rank_fn), plan)
    >>> out.shape
    torch.Size([10, 4, 16])
    """
    check_qkv(q, k, v)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if group.size != plan.size:
        raise ValueError(f"the plan is for {plan.size} PCP ranks but the group has {group.size}; rebuild the plan")
    r = group.rank
    if q.shape[0] != plan.num_tokens[r] or k.shape[0] != plan.num_tokens[r]:
        raise ValueError(
            f"rank {r} holds {plan.num_tokens[r]} tokens in the plan but got q {q.shape[0]}, k {k.shape[0]}; "
            "pass pcp_shard(x, plan, group.rank)"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    acc = _Acc(q.shape[0], q.shape[1], v.shape[-1], q)
    na = plan.num_a(r)
    rows_a, rows_b = slice(0, na), slice(na, q.shape[0])
    q_a, q_b = q[rows_a], q[rows_b]
    cu_a, cu_b = plan.cu_a[r].to(q.device), plan.cu_b[r].to(q.device)

    if context is not None:
        acc.add(rows_a, *context.attend(q_a, cu_a, scale, group))
        acc.add(rows_b, *context.attend(q_b, cu_b, scale, group))
    if method == "ring":
        _ring(q_a, q_b, k, v, plan, group, scale, acc, rows_a, rows_b)
    else:
        _allgather(q_a, q_b, k, v, plan, group, scale, acc, rows_a, rows_b)
    out = acc.out.to(q.dtype)
    return (out, acc.lse) if return_lse else out


def _attend(acc, rows, q, cu_q, kv, cu_k, dk, causal, scale):
    """One block: q [Tq, Hq, Dqk] vs packed kv [Tk, Hkv, Dqk + Dv], merged into acc[rows]."""
    if q.shape[0] == 0 or int(cu_k[-1]) == 0:
        return
    o, l = attention_with_lse(q, kv[..., :dk], kv[..., dk:], cu_q, cu_k, causal=causal, softmax_scale=scale)
    acc.add(rows, o, l)


def _ring(q_a, q_b, k, v, plan, group, scale, acc, rows_a, rows_b):
    p, r, dk = plan.size, group.rank, k.shape[-1]
    dev = q_a.device
    cu_a, cu_b = plan.cu_a[r].to(dev), plan.cu_b[r].to(dev)
    kv = torch.cat([k, v], dim=-1)  # [T_r, Hkv, Dqk + Dv]: one message per step
    src = r
    for s in range(p):
        pending = None
        if s + 1 < p:  # start the next transfer before computing this step
            nxt = (r - s - 1) % p
            pending = group.ring_exchange(kv, (plan.num_tokens[nxt], *kv.shape[1:]))
        na_src = plan.num_a(src)
        kv_a, kv_b = kv[:na_src], kv[na_src:]
        cu_ka, cu_kb = plan.cu_a[src].to(dev), plan.cu_b[src].to(dev)
        if s == 0:
            _attend(acc, rows_a, q_a, cu_a, kv_a, cu_ka, dk, True, scale)
            _attend(acc, rows_b, q_b, cu_b, kv_a, cu_ka, dk, False, scale)
            _attend(acc, rows_b, q_b, cu_b, kv_b, cu_kb, dk, True, scale)
        elif src < r:
            _attend(acc, rows_a, q_a, cu_a, kv_a, cu_ka, dk, False, scale)
            _attend(acc, rows_b, q_b, cu_b, kv_a, cu_ka, dk, False, scale)
        else:
            _attend(acc, rows_b, q_b, cu_b, kv_a, cu_ka, dk, False, scale)
            _attend(acc, rows_b, q_b, cu_b, kv_b, cu_kb, dk, False, scale)
        if pending is not None:
            kv, src = pending.wait(), (r - s - 1) % p


def _allgather(q_a, q_b, k, v, plan, group, scale, acc, rows_a, rows_b):
    r, dk, dev = group.rank, k.shape[-1], q_a.device
    kv = torch.cat([k, v], dim=-1)  # [T_r, Hkv, Dqk + Dv]
    kv = torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, plan.max_tokens - kv.shape[0]))  # equal shapes
    everything = group.all_gather(kv)  # [P * max_tokens, Hkv, Dqk + Dv], rank-major
    idx_a, cu_ka, idx_b, cu_kb = plan.prefix_index[r]
    _attend(acc, rows_a, q_a, plan.cu_a[r].to(dev), everything[idx_a.to(dev)], cu_ka.to(dev), dk, True, scale)
    _attend(acc, rows_b, q_b, plan.cu_b[r].to(dev), everything[idx_b.to(dev)], cu_kb.to(dev), dk, True, scale)
