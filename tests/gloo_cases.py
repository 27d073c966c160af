"""Module-level rank functions for tests that run real gloo processes (spawn pickles them by name)."""

import torch

from cpattn import pcp_plan, pcp_prefill, pcp_shard
from cpattn.pcp import Context


def collectives(group):
    """Every Group collective once; returns results and byte counters."""
    r, n = group.rank, group.size
    x = torch.arange(3.0) + 10 * r
    return {
        "all_gather": group.all_gather(x),
        "all_gather_dim1": group.all_gather(x[None], dim=1),
        "reduce_scatter": group.reduce_scatter(torch.arange(2.0 * n) * (r + 1)),
        "all_to_all": group.all_to_all(torch.arange(float(n)) + 100 * r),
        "all_reduce": group.all_reduce(x),
        "ring": group.ring_exchange(x, (3,)).wait(),
        "stats": group.stats.as_dict(),
    }


def pcp_cases(group, cases):
    """Run pcp_prefill for each (q, k, v, cu, method, ctx) case; return this rank's outputs."""
    outs = []
    for q, k, v, cu, method, ctx in cases:
        plan = pcp_plan(cu, group.size, context_lens=None if ctx is None else ctx[2].diff().tolist())
        s = lambda x: pcp_shard(x, plan, group.rank)  # noqa: E731
        context = None if ctx is None else Context(*ctx)
        outs.append(pcp_prefill(s(q), s(k), s(v), plan, group=group, method=method, context=context))
    return outs


def hang_rank1(group):
    """Rank 1 skips the collective: rank 0 must time out, not hang."""
    if group.rank == 0:
        group.all_reduce(torch.ones(2))
    return group.rank
