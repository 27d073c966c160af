"""A DCP-sharded cache of earlier tokens as the context of a prefill (chunked prefill over DCP).

"Context" as in docs/engine.md "Words": one layer's K/V of the tokens before the new ones, as an
attention call reads it (:class:`cpattn.Context` is the contiguous, replicated kind)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.layout.dcp import dcp_local_lens
from cpattn.layout.rows import request_of
from cpattn.ops import checks, merge_attn_states
from cpattn.ops.paged import paged_attention_with_lse
from cpattn.ops.ref import acc_dtype
from cpattn.dcp.decode import dcp_attend_heads


@dataclass(frozen=True)
class DCPContext:
    """A DCP-sharded paged cache of earlier tokens, usable as ``pcp_prefill(context=...)``.

    Every new token of request b sees all ``context_lens[b]`` cached tokens
    (non-causally); rank r holds its DCP share of them.

    Fields
    ------
    k_cache: [num_blocks, block_size, Hkv, Dk]; v_cache: [.., .., Hkv, Dv]
        (MLA: the latent cache and ``latent[..., :512]``) -- this rank's shard.
    block_table: [B, max_blocks]; context_lens: [B] cached tokens per request.
    interleave_size: I of the DCP layout.
    group: the DCP group; None means the group ``attend`` is called with.
    shard: how the query rows differ across the group --
        "tokens": each rank holds different tokens with all heads (a PCP group
        that is also the DCP group): queries are all-gathered by token, each
        rank attends all of them against its shard, and an all-to-all brings
        every rank its own tokens' N partials to merge;
        "heads": every rank holds the same tokens and its own TP heads (as in
        :func:`dcp_decode`).
    merge: "ag_rs" or "a2a", for ``shard="heads"``.

    Example
    -------
    >>> # ctx = DCPContext(kc, vc, block_table, context_lens, interleave_size=16)
    >>> # out = pcp_prefill(q, k, v, plan, group=g, context=ctx)
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    interleave_size: int
    group: Group | None = None
    shard: str = "tokens"
    merge: str = "a2a"

    def attend(self, q: torch.Tensor, cu_q: torch.Tensor, scale: float, group: Group):
        """Partial attention of q [Tq, Hq, Dk] (request b: rows cu_q[b]:cu_q[b+1]) over the cached context.

        Returns out [Tq, Hq, Dv] float32 and lse [Tq, Hq] float32, merged over the DCP group.
        """
        g = self.group if self.group is not None else group
        if self.shard not in ("tokens", "heads"):
            raise ValueError(f"shard must be 'tokens' or 'heads'; got {self.shard!r}")
        dev = q.device
        checks.int_tensor("context_lens", self.context_lens, dims=1, desc="[B]")
        checks.int_tensor("block_table", self.block_table, dims=2, desc="[B, max_blocks]")
        checks.cu_seqlens("cu_q", cu_q, total=q.shape[0], of=f"q has {q.shape[0]} rows", exact=True)
        cu = cu_q.to(dev, torch.int64)
        ctx = self.context_lens.to(dev, torch.int64)
        if cu.shape[0] != ctx.shape[0] + 1:
            raise ValueError(f"cu_q has {cu.shape[0]} entries but context_lens covers {ctx.shape[0]} requests")
        if self.block_table.shape[0] != ctx.shape[0]:
            raise ValueError(
                f"block_table has {self.block_table.shape[0]} rows but context_lens covers {ctx.shape[0]} "
                "requests; give every request one row"
            )
        checks.within("context_lens", ctx, 0, None, expected="a count of cached tokens >= 0")
        local = dcp_local_lens(ctx, g.size, self.interleave_size)[:, g.rank]  # [B] keys every new token sees here
        self._check_fits(ctx, local, g.rank)
        if self.shard == "heads":
            req = request_of(cu, torch.arange(q.shape[0], device=cu.device), past=-1)
            kv_lens = torch.where(req >= 0, local[req.clamp(min=0)], 0)
            return dcp_attend_heads(q, self.k_cache, self.v_cache, self.block_table, req, kv_lens,
                                    group=g, merge=self.merge, softmax_scale=scale)
        return self._attend_tokens(q, cu, local, scale, g)

    def _check_fits(self, ctx: torch.Tensor, local: torch.Tensor, rank: int) -> None:
        """Every request's cached tokens on this rank fit its block-table row (one host read)."""
        reach = self.block_table.shape[1] * self.k_cache.shape[1]
        far = local > reach
        if checks.values_checkable() and bool(far.any()):
            b = int(far.nonzero()[0])
            raise ValueError(
                f"context_lens[{b}] = {int(ctx[b])} puts {int(local[b])} cached tokens on DCP rank {rank}, but a "
                f"block_table row addresses {self.block_table.shape[1]} x {self.k_cache.shape[1]} = {reach} slots; "
                "widen the block table"
            )

    def _attend_tokens(self, q, cu, local, scale, g):
        n, t = g.size, q.shape[0]
        cus = g.all_gather(cu[None], dim=0)  # [N, B+1]: every rank's request boundaries
        t_max = int(cus[:, -1].max())  # host sync: prefill runs eagerly
        dv = self.v_cache.shape[-1]
        acc = acc_dtype(q)
        if t_max == 0:
            return q.new_zeros(t, q.shape[1], dv, dtype=acc), torch.full((t, q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        q_pad = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, t_max - t))  # [t_max, Hq, Dk]
        q_all = g.all_gather(q_pad, dim=0)  # [N*t_max, Hq, Dk]
        rows = torch.arange(t_max, device=cus.device)
        req = torch.cat([request_of(cus[j], rows, past=-1) for j in range(n)])  # [N*t_max]
        kv_lens = torch.where(req >= 0, local[req.clamp(min=0)], 0)
        o, l = paged_attention_with_lse(q_all, self.k_cache, self.v_cache, self.block_table, req, kv_lens,
                                        softmax_scale=scale)  # [N*t_max, Hq, Dv], [N*t_max, Hq]
        buf = torch.cat([o.to(acc), l.to(acc)[..., None]], dim=-1)  # [N*t_max, Hq, Dv+1]
        got = g.all_to_all(buf, dim=0).view(n, t_max, q.shape[1], dv + 1)  # partials of my tokens from each rank
        out, lse = merge_attn_states(got[..., :dv], got[..., dv])
        return out[:t], lse[:t]
