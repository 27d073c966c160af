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


def algorithms(group):
    """Each collective with DistGroup's "native" and "a2a" algorithms on this rank's seeded inputs.

    Shapes include a gathered dim that is not dim 0, bf16, an odd element
    count and a tensor above SMALL_BYTES (where a2a falls back to native).
    """
    from cpattn.comm import dist as cdist

    out = {"auto": group.algorithm}
    for algo in ("native", "a2a"):
        g = cdist.DistGroup(algorithm=algo)
        n = g.size
        for name, x in inputs(g.rank, n).items():
            res = {
                "all_gather": g.all_gather(x, dim=1),
                "reduce_scatter": g.reduce_scatter(x, dim=1) if x.shape[1] % n == 0 else None,
                "all_reduce": g.all_reduce(x),
                "all_to_all": g.all_to_all(x, dim=1) if x.shape[1] % n == 0 else None,
            }
            out[(algo, name)] = res
        out[(algo, "stats")] = g.stats.as_dict()
    return out


def collectives_and_algorithms(group):
    """:func:`collectives` (its byte counters first), then :func:`algorithms` (groups of their own): one spawn
    serves both gloo tests of a world size."""
    return {"collectives": collectives(group), "algorithms": algorithms(group)}


def inputs(rank, n):
    """Seeded per-rank tensors for :func:`algorithms` (the test rebuilds every rank's)."""
    from cpattn.comm.dist import SMALL_BYTES

    gen = torch.Generator().manual_seed(100 + rank)
    big = SMALL_BYTES // 4 // n + 7  # float32 elements: over the small-message limit
    return {
        "f32": torch.randn(3, 2 * n, 5, generator=gen),
        "bf16": torch.randn(4, n, 3, generator=gen).bfloat16(),
        "odd": torch.randn(1, 3, 7, generator=gen),
        "big": torch.randn(1, big, generator=gen),
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


def demo_cases(group, specs):
    """``cpattn demo``'s rank function (:func:`cpattn.bench.demo.run_rank`) for each spec in turn on the same
    ranks; each run seeds itself and resets the byte counters per phase, so the runs do not see each other."""
    from cpattn.bench import demo

    return [demo.run_rank(group, spec) for spec in specs]
