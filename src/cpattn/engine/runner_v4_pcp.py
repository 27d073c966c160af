"""A DeepSeek-V4 step-loop prefill into the runner's slots, on every DCP rank, PCP over the DCP group, a sub-group
or a wider world.

:class:`~cpattn.engine.runner_v4.V4StepRunner` prefills a step's new prompts over its *prefill group*
(:func:`prefill_group`): one rank (``pcp_size = 1``: every DCP rank computes the same prefill), the DCP
group (``pcp_size = dcp_size``), or its first P ranks (``1 < P < N``, None on the others). A rank of the
prefill group collects the state (tail rows + compressed entries, the same on every PCP rank) and places
its DCP share in the requests' slots (:mod:`cpattn.v4.handoff`). DCP rank d outside the sub-group (d >= P)
computes nothing: it gets each request's *share* (:mod:`cpattn.v4.share`: ring rows at positions
``[L - back, L)``, the entries and indexer keys it owns) from PCP rank ``d % P`` over the DCP group, as a P/D
consumer gets it from its producer (:mod:`cpattn.engine.connector_v4`), and the first-token logits (prompt
logits, hidden states) from DCP rank 0 (:func:`cpattn.engine.runner_pcp.outputs_from_rank0`), so every rank
holds what the N-rank DCP decode expects and samples the same tokens.

PCP wider than the DCP group (``pcp_size = P > dcp_size = N``, :mod:`cpattn.engine.runner_wide`): the prefill
group is the engine's whole world of P ranks; every rank collects the whole state and gets the outputs, DCP
ranks 0..N-1 place their shares (no message: each holds the collected state), ranks N..P-1 hold no state
(``runner.holder`` None) and take DCP rank 0's decode outputs.

Example
-------
>>> import cpattn
>>> from cpattn.models import deepseek_v4 as v4
>>> from cpattn.engine.runner_v4 import V4StepRunner
>>> from cpattn.engine.scheduler import SchedulerOutput
>>> cfg = v4.DeepseekV4Config.tiny()
>>> params = v4.init_params(cfg)
>>> def rank(g):
...     run = V4StepRunner(g, "deepseek_v4", params, cfg, num_blocks=8, block_size=4, max_model_len=32, pcp_size=2)
...     ps = prefill_slots(run, [list(range(1, 20))], [0])
...     return run.prefill_group is None, run.holder.cache.seq_lens[0], ps.first.argmax(-1).tolist()
>>> out = cpattn.simulate(3, rank)
>>> [o[0] for o in out], {o[1:] == out[0][1:] for o in out}, out[0][1]
([False, False, True], {True}, 19)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cpattn.comm.group import Group
from cpattn.comm.sim import SimMesh
from cpattn.engine.batch import Prompts
from cpattn.engine.runner_pcp import outputs_from_rank0
from cpattn.models.family import param_dtype
from cpattn.v4.handoff import V4Handoff
from cpattn.v4.prefill import GatheredEntries
from cpattn.v4.share import export_share, place_share, share_numel


def prefill_group(group: Group, pcp_size: int) -> Group | None:
    """The group a V4 runner's prefills run over: one rank of its own (``pcp_size`` 1, replicated on every DCP
    rank), ``group`` (``pcp_size = group.size``), or its first ``pcp_size`` ranks (None on the others). Every
    rank of ``group`` calls it (a split is collective)."""
    if pcp_size == 1:
        return SimMesh(1).groups()[0]
    return group if pcp_size == group.size else group.split(range(pcp_size))


def to_slots(h: V4Handoff, slots: list[int], batch: int) -> V4Handoff:
    """A hand-off of ``len(slots)`` requests re-addressed to cache rows ``slots`` of a ``batch``-row cache
    (the other rows: length 0, nothing to write)."""
    where = torch.tensor(slots, dtype=torch.int64)
    lens = [0] * batch
    for j, s in enumerate(slots):
        lens[s] = h.lens[j]
    offsets = {}
    for kind, off in h.entries.offsets.items():
        full = torch.zeros(batch, dtype=off.dtype, device=off.device)
        full[where.to(off.device)] = off
        offsets[kind] = full
    tail = replace(h.tail, requests=where.to(h.tail.requests.device)[h.tail.requests.long()])
    return V4Handoff(tuple(lens), tail, GatheredEntries(h.entries.entries, h.entries.index_keys, offsets))


@dataclass(frozen=True)
class PrefilledSlots:
    """What :func:`prefill_slots` leaves: ``first`` [B, V] the first-token logits; ``prompt_logits`` [T, V]
    (request order) or None; ``hidden`` ``{name: [T, ...]}`` (request order) or None; ``collected`` the
    prefill's :class:`~cpattn.v4.handoff.V4Handoff` (None on a rank outside a PCP sub-group)."""

    first: torch.Tensor
    prompt_logits: torch.Tensor | None
    hidden: dict | None
    collected: V4Handoff | None


def prefill_slots(runner, prompts: list[list[int]], slots: list[int], *, prompt_logits: bool = False
                  ) -> PrefilledSlots:
    """Prefill ``prompts`` (whole, from position 0) over ``runner.prefill_group`` and seed cache rows ``slots``
    of ``runner.holder`` with each request's state (this DCP rank's share; ``seq_lens`` set to the prompts');
    every rank of ``runner.group`` calls it with the same arguments."""
    g, pg, backend = runner.group, runner.prefill_group, runner.backend
    batch = Prompts.of(prompts, vocab_size=runner.cfg.vocab_size)
    res = collected = None
    if pg is not None:
        res = backend.prefill(pg, runner.family, runner.params, runner.cfg, batch, algorithms=runner.algorithms,
                              prompt_logits=prompt_logits, hidden_layers=runner.hidden_layers)
        collected = backend.collect(pg, res)
    if pg is not None and g is not None:  # a DCP rank that prefilled: its share into the slots
        before = runner.holder.cache
        backend.place(runner.holder, to_slots(collected, slots, before.batch), g)
        lens, high = list(before.seq_lens), list(before.high_water)
        for s, n in zip(slots, collected.lens):
            lens[s] = high[s] = n
        runner.holder.cache = replace(runner.holder.cache, seq_lens=tuple(lens), high_water=tuple(high))
    if runner.pcp_size == 1 or pg is runner.world:  # every rank prefilled (alone, or in the PCP group)
        return PrefilledSlots(res.first_logits, res.prompt_logits, res.hidden, collected)
    send_shares(runner, collected, [len(p) for p in prompts], slots)
    first, full, hidden = outputs_from_rank0(g, None if res is None else res.first_logits,
                                             None if res is None else res.prompt_logits,
                                             None if res is None else res.hidden, prompt_logits=prompt_logits,
                                             hidden_layers=runner.hidden_layers)
    return PrefilledSlots(first, full, hidden, collected)


def send_shares(runner, collected: V4Handoff | None, lens: list[int], slots: list[int]) -> None:
    """PCP rank r of P sends DCP rank d >= P (r = d % P) every request's share for d, back to back in request
    order (one message; sizes from the layout and ``lens``, no header); rank d places them in ``slots``."""
    g, p = runner.group, runner.pcp_size
    cache = runner.holder.cache
    lay, n, inter = cache.layout, g.size, cache.interleave_size
    dtype = param_dtype(runner.params)
    if g.rank < p:
        for d in range(p + g.rank, n, p):
            g.send(torch.cat([export_share(collected, j, lay, rank=d, size=n, interleave=inter).to(dtype)
                              for j in range(len(lens))]), d)
        return
    sizes = [share_numel(lay, L, rank=g.rank, size=n, interleave=inter) for L in lens]
    flats = g.recv((sum(sizes),), dtype, g.rank % p).split(sizes)
    for s, L, flat in zip(slots, lens, flats):
        cache = place_share(cache, s, L, flat)
    runner.holder.cache = cache
