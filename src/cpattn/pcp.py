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
from cpattn.ops import attention_with_lse, checks
from cpattn.ops.merge import merge_into
from cpattn.ops.attention import check_qkv
from cpattn.ops.ref import acc_dtype

METHODS = ("ring", "allgather")


@dataclass(frozen=True)
class Context:
    """One layer's context: the cached K/V of the tokens before each request's new ones, contiguous and
    replicated on every rank (docs/engine.md "Words": the engine's prefix, as one attention call reads it).

    k: [Tc, Hkv, Dqk]; v: [Tc, Hkv, Dv]; cu_seqlens: [B+1] -- request b's
    cached keys are ``k[cu_seqlens[b]:cu_seqlens[b+1]]``; every new token of
    request b sees all of them.
    """

    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor

    def __post_init__(self):
        for name, x in (("Context.k", self.k), ("Context.v", self.v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                raise ValueError(f"{name} must be a [Tc, Hkv, D] tensor; got {getattr(x, 'shape', type(x).__name__)}")
        if self.k.shape[:2] != self.v.shape[:2]:
            raise ValueError(f"Context.k {tuple(self.k.shape)} and Context.v {tuple(self.v.shape)} must agree on [Tc, Hkv]")
        checks.cu_seqlens("Context.cu_seqlens", self.cu_seqlens, total=self.k.shape[0],
                          of=f"Context.k has {self.k.shape[0]} tokens")

    def attend(self, q, cu_q, scale, group):
        """Partial attention of q [Tq, Hq, D] (requests by cu_q) over the context."""
        if cu_q.shape != self.cu_seqlens.shape:
            raise ValueError(
                f"Context.cu_seqlens covers {self.cu_seqlens.shape[0] - 1} requests but the plan has "
                f"{cu_q.shape[0] - 1}; give the context one entry per request (0 cached tokens is fine)"
            )
        return attention_with_lse(q, self.k, self.v, cu_q, self.cu_seqlens, causal=False, softmax_scale=scale)


class _Acc:
    """Running LSE merge of partials over rows [T, H, Dv], in float32 (float64 for float64 input).

    The first partial that covers every row becomes the accumulator (no copy);
    a partial for rows nothing has touched yet is copied in; anything else is
    merged in place (``merge_into``; untouched rows hold (0, -inf), which
    merge exactly).
    """

    def __init__(self, t, h, dv, like: torch.Tensor):
        self.shape, self.dtype, self.device = (t, h, dv), acc_dtype(like.dtype), like.device
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.touched: list[tuple[int, int]] = []

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        if out.shape[0] == 0:
            return
        t = self.shape[0]
        if self.out is None and rows.start == 0 and rows.stop == t and out.dtype == lse.dtype == self.dtype:
            self.out, self.lse = out, lse  # a fresh result of the attention op: adopt it
        elif any(rows.start < b and a < rows.stop for a, b in self.touched):
            merge_into(self.out[rows], self.lse[rows], out, lse)
        else:
            self._alloc()
            self.out[rows] = out
            self.lse[rows] = lse
        self.touched.append((rows.start, rows.stop))

    def _alloc(self) -> None:
        if self.out is None:
            self.out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.lse = torch.full(self.shape[:2], float("-inf"), dtype=self.dtype, device=self.device)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._alloc()
        return self.out, self.lse


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
    if not isinstance(plan, PCPPlan):
        raise ValueError(f"plan must be a PCPPlan from pcp_plan(cu_seqlens, pcp_size); got {type(plan).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if group.size != plan.pcp_size:
        raise ValueError(f"the plan is for {plan.pcp_size} PCP ranks but the group has {group.size}; rebuild the plan")
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
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # head-major storage: contiguous rows per head
    q_a, q_b = q[rows_a], q[rows_b]
    cu_a, cu_b = plan.cu_a[r].to(q.device), plan.cu_b[r].to(q.device)

    if context is not None:
        acc.add(rows_a, *context.attend(q_a, cu_a, scale, group))
        acc.add(rows_b, *context.attend(q_b, cu_b, scale, group))
    if method == "ring":
        _ring(q, q_a, q_b, k, v, plan, group, scale, acc, rows_a, rows_b)
    else:
        _allgather(q_a, q_b, k, v, plan, group, scale, acc, rows_a, rows_b)
    out, lse = acc.result()
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def _attend(acc, rows, q, cu_q, k, v, cu_k, causal, scale):
    """One block: q [Tq, Hq, Dqk] vs k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv], merged into acc[rows]."""
    if q.shape[0] == 0 or int(cu_k[-1]) == 0:
        return
    acc.add(rows, *attention_with_lse(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale))


def _span(n: int, device) -> torch.Tensor:
    """cu_seqlens [0, n] of a single request."""
    return torch.tensor([0, n], dtype=torch.int32, device=device)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k [T, Hkv, Dk], v [T, Hkv, Dv] -> one flat head-major message [Hkv*T*Dk + Hkv*T*Dv].

    Written straight into one buffer (two transposing copies, no concatenation pass).
    """
    t, hkv, dk = k.shape
    dv = v.shape[-1]
    msg = k.new_empty(hkv * t * (dk + dv))
    n = hkv * t * dk
    msg[:n].view(hkv, t, dk).copy_(k.transpose(0, 1))
    msg[n:].view(hkv, t, dv).copy_(v.transpose(0, 1))
    return msg


def _unpack(msg: torch.Tensor, t: int, hkv: int, dk: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views k [t, Hkv, Dk], v [t, Hkv, Dv] of a :func:`_pack` message; each head's rows are contiguous."""
    n = hkv * t * dk
    return msg[:n].view(hkv, t, dk).transpose(0, 1), msg[n:].view(hkv, t, dv).transpose(0, 1)


def _needs_b(src: int, step: int, p: int) -> bool:
    """Whether a rank the KV of ``src`` still visits after ``step`` attends its second half (chunk b).

    The KV of rank ``src`` reaches rank ``(src + t) % p`` at step t. Rank j uses kv_b of src
    only when src > j (its q_b comes after both of src's chunks); ranks after src in the ring
    order use kv_a alone. So once no later visitor is below src, only kv_a travels on.

    >>> [_needs_b(0, 0, 2), _needs_b(1, 0, 2)]  # P = 2: rank 1 uses only kv_a of rank 0
    [False, True]
    """
    return any((src + t) % p < src for t in range(step + 1, p))


def _ring(q, q_a, q_b, k, v, plan, group, scale, acc, rows_a, rows_b):
    p, r, dev = plan.pcp_size, group.rank, q_a.device
    hkv, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    cu_a, cu_b = plan.cu_a[r].to(dev), plan.cu_b[r].to(dev)
    t_r, one_request = plan.num_tokens[r], plan.num_requests == 1
    rows_all = slice(0, t_r)
    # one head-major message per step: the kernel then reads each head's keys as contiguous rows.
    # A message carries only kv_a once no rank it still visits needs kv_b (_needs_b): fewer bytes.
    msg, src, whole = _pack(k, v), r, True
    for s in range(p):
        pending = None
        if s + 1 < p:  # start the next transfer before computing this step
            send = msg
            if whole and not _needs_b(src, s, p):  # kv_a alone travels on
                ks, vs = _unpack(msg, plan.num_tokens[src], hkv, dk, dv)
                send = _pack(ks[: plan.num_a(src)], vs[: plan.num_a(src)])
            nxt = (r - s - 1) % p  # whose KV arrives: its sender applied the same rule
            n_recv = plan.num_tokens[nxt] if _needs_b(nxt, s, p) else plan.num_a(nxt)
            pending = group.ring_exchange(send, (n_recv * hkv * (dk + dv),))
        t_src = plan.num_tokens[src] if whole else plan.num_a(src)
        ks, vs = _unpack(msg, t_src, hkv, dk, dv)
        na = plan.num_a(src)
        k_a, v_a, k_b, v_b = ks[:na], vs[:na], ks[na:], vs[na:]
        cu_ka, cu_kb = plan.cu_a[src].to(dev), plan.cu_b[src].to(dev)
        if one_request:  # [A | B] is the request's [a | b]: one kernel call per step
            if s == 0:  # square causal over [a | b]: q_b sees all of a and b up to itself
                _attend(acc, rows_all, q, _span(t_r, dev), ks, vs, _span(t_src, dev), True, scale)
            elif src < r:
                _attend(acc, rows_all, q, _span(t_r, dev), k_a, v_a, cu_ka, False, scale)
            else:
                _attend(acc, rows_b, q_b, cu_b, ks, vs, _span(t_src, dev), False, scale)
        elif s == 0:
            _attend(acc, rows_a, q_a, cu_a, k_a, v_a, cu_ka, True, scale)
            _attend(acc, rows_b, q_b, cu_b, k_a, v_a, cu_ka, False, scale)
            _attend(acc, rows_b, q_b, cu_b, k_b, v_b, cu_kb, True, scale)
        elif src < r:  # kv_a' precedes all local chunks; kv_b' follows them
            _attend(acc, rows_a, q_a, cu_a, k_a, v_a, cu_ka, False, scale)
            _attend(acc, rows_b, q_b, cu_b, k_a, v_a, cu_ka, False, scale)
        else:  # only q_b comes after both halves of rank src
            _attend(acc, rows_b, q_b, cu_b, k_a, v_a, cu_ka, False, scale)
            _attend(acc, rows_b, q_b, cu_b, k_b, v_b, cu_kb, False, scale)
        if pending is not None:
            src = (r - s - 1) % p
            msg, whole = pending.wait(), _needs_b(src, s, p)


def _allgather(q_a, q_b, k, v, plan, group, scale, acc, rows_a, rows_b):
    r, dk, dev = group.rank, k.shape[-1], q_a.device
    kv = torch.cat([k, v], dim=-1)  # [T_r, Hkv, Dqk + Dv]
    kv = torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, plan.max_tokens - kv.shape[0]))  # equal shapes
    everything = group.all_gather(kv)  # [P * max_tokens, Hkv, Dqk + Dv], rank-major
    idx_a, cu_ka, idx_b, cu_kb = plan.prefix_index[r]
    for rows, q_part, cu_q, idx, cu_k in ((rows_a, q_a, plan.cu_a[r], idx_a, cu_ka), (rows_b, q_b, plan.cu_b[r], idx_b, cu_kb)):
        kv_part = everything[idx.to(dev)]  # [L, Hkv, Dqk + Dv]: each request's keys up to its chunk end
        _attend(acc, rows, q_part, cu_q.to(dev), kv_part[..., :dk], kv_part[..., dk:], cu_k.to(dev), True, scale)
