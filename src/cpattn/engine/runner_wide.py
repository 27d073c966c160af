"""PCP over more ranks than the DCP group, in one engine of the step loop (``pcp_size = P > dcp_size = N``).

The engine's world has P ranks; its DCP group is the world's first N ranks (``StepRunner.group``; None on
ranks N..P-1), and only they hold a KV cache (interleaved as usual, blocks of the one block manager). A
step's prefill chunks run PCP over the whole world (``StepRunner.pcp_group`` is the world,
:mod:`cpattn.engine.runner_pcp`): each chunk's cached context is gathered from the DCP shards onto every
PCP rank (the ranks outside the DCP group contribute nothing), and the new rows go to their DCP owners
(:func:`~cpattn.engine.handoff.exchange` over the world with a decode size N). Decode rows (and chunks run
with them, elastic CP) run DCP over the first N ranks only; the ranks N..P-1 run no model for them and take
DCP rank 0's step outputs (logits, argmax, hidden states: :func:`step_from_rank0`), so every rank samples the
same tokens, and the scheduler each rank runs (the same deterministic copy, its block manager handing out
ids that refer to no storage there) stays in step: preemption by recompute, later chunks, prefix hits.

N = 1 is PCP prefill with one-rank decode. The runners that keep their own caches run it the same way: DeepSeek-V4
(:mod:`cpattn.engine.runner_v4_pcp`: its state on the first N ranks only) and hybrid models
(:mod:`cpattn.engine.runner_hybrid_pcp`: KV rows and linear states on the first N ranks only). A KV pool as the
prefix cache's second tier works here (every rank's scheduler looks the same spans up; the DCP ranks write the
loaded blocks and store their own, the others hold none, so store none); a P/D connector is not offered this
layout (:func:`check_engine`: it hands a producer rank's blocks to a consumer rank).

>>> import cpattn
>>> cpattn.simulate(3, lambda g: (lambda w, n, d: (w.size, n, d and d.size))(*dcp_of(g, 2, 3)))
[(3, 2, 2), (3, 2, 2), (3, 2, None)]
"""

from __future__ import annotations

from cpattn.comm.group import Group
from cpattn.engine.connector import KVConnector, MultiConnector, PoolConnector
from cpattn.engine.runner_pcp import from_rank0


def dcp_of(world: Group, dcp_size: int | None, pcp_size: int) -> tuple[Group, int, Group | None]:
    """(world, N, this rank's DCP group) of a runner over ``world``: the world itself when ``dcp_size`` is None
    or ``world.size``; else (``pcp_size = world.size > dcp_size``) its first ``dcp_size`` ranks, None on the
    others. Every rank of ``world`` calls it (a split).

    >>> from cpattn.comm.sim import SimMesh
    >>> w = SimMesh(1).groups()[0]
    >>> dcp_of(w, None, 1)[1:] == (1, w)
    True
    """
    if dcp_size is None or dcp_size == world.size:
        return world, world.size, world
    if isinstance(dcp_size, bool) or not isinstance(dcp_size, int) or not 1 <= dcp_size < world.size \
            or pcp_size != world.size:
        raise ValueError(f"StepRunner(dcp_size={dcp_size!r}, pcp_size={pcp_size!r}) over a world of {world.size}: "
                         f"a DCP group smaller than the world takes its first dcp_size ranks under PCP over all "
                         f"of them; pass dcp_size in 1..{world.size} with pcp_size={world.size}")
    return world, dcp_size, world.split(range(dcp_size))


def step_from_rank0(world: Group, res: tuple | None, hidden_layers: tuple | None) -> tuple:
    """DCP rank 0's outputs of a DCP step, ``(logits [T, V], argmax [T][, {name: [T, ...]}])``, on every rank
    of ``world`` (``res`` None on a rank outside the DCP group): bit for bit, so every rank picks the same."""
    logits = from_rank0(world, None if res is None else res[0])
    greedy = from_rank0(world, None if res is None else res[1])
    if hidden_layers is None:
        return logits, greedy
    names = [*sorted({i for i in hidden_layers if i != "norm"}), "norm"]  # the forward's keys: layers, "norm"
    return logits, greedy, {n: from_rank0(world, None if res is None else res[2][n]) for n in names}


def check_engine(family, pcp_size: int, dcp_size: int, world: Group | None, connector) -> int:
    """The number of ranks an LLMEngine of this layout runs on (``max(pcp_size, dcp_size)``); a ValueError for
    what it refuses: ``pcp_size > dcp_size`` with a KV connector other than a pool tier (P/D), or a ``world``
    of another size. ``connector``: the engine's ``kv_pool`` (a spec or an open pool) or ``kv_connector``.

    >>> from cpattn.models.family import get_family
    >>> check_engine(get_family("qwen3"), 4, 2, None, None), check_engine(get_family("deepseek_v4"), 3, 2, None, None)
    (4, 3)
    """
    p, n = pcp_size, dcp_size
    members = getattr(connector, "connectors", (connector,)) if isinstance(connector, MultiConnector) else (connector,)
    hands_off = any(isinstance(c, KVConnector) and not isinstance(c, PoolConnector) for c in members)
    if p > n and hands_off:
        raise ValueError(f"pcp_size={p} with dcp_size={n}: a P/D connector hands a producer rank's blocks to a "
                         f"consumer rank, so every rank must hold its blocks; pass pcp_size=1..{n} (a KV pool "
                         "alone works with this layout)")
    ranks = max(p, n)
    if world is not None and world.size != ranks:
        raise ValueError(f"world: a group of {world.size} ranks, but the config's max(pcp_size, dcp_size) is "
                         f"{ranks}; start that many ranks or pass their config")
    return ranks
