"""A hybrid step's prefill chunks under PCP, over the DCP group, its first ``pcp_size`` ranks, or a wider world.

:class:`~cpattn.engine.runner_hybrid.HybridStepRunner` runs a step's long prefill chunks (every row a
prefill) split head-tail over its PCP group (``runner.pcp_group``: the DCP group, or its first P ranks when
``1 < P < N``, None on the others) by :func:`cpattn.engine.backends.hybrid.hybrid_prefill`: the
full-attention layers by ring / all-gather attention over the chunk with its cached context (gathered from
the DCP shards, :func:`cpattn.engine.runner_pcp.cached_rows`) as a replicated prefix, the linear layers by the
exact scan continuing each request's slot states. Then, on every DCP rank:

- the chunk's new KV rows [T, F] go to their DCP owners over the whole DCP group
  (:func:`cpattn.engine.handoff.exchange`; a rank outside the sub-group sends none and knows the split
  host-side);
- the linear layers' states after the chunk (conv [B, K-1, C] and recurrent [B, Hv, Dk, Dv] per linear
  layer, the same on every PCP rank) are written back to the requests' slots -- replicated, as the DCP decode
  expects: a rank outside the sub-group takes DCP rank 0's (:func:`cpattn.engine.runner_pcp.from_rank0`, one
  message per dtype), with the first-token logits, prompt logits and hidden states
  (:func:`cpattn.engine.runner_pcp.outputs_from_rank0`).

PCP wider than the DCP group (``pcp_size = P > dcp_size = N``, :mod:`cpattn.engine.runner_wide`): the PCP group is
the engine's world of P ranks, its first N the DCP group (``runner.group``, None on the others, which hold no KV
and no slot states). A chunk continuing a cached context starts, on every PCP rank, from DCP rank 0's slot states
(one message per dtype); the context rows are gathered from the DCP shards (the others add zeros), the new rows go
to their DCP owners over the world (:func:`~cpattn.engine.handoff.exchange` with decode size N), and the states
after the chunk and the outputs are every PCP rank's own (the same on all), written to the slots on the DCP ranks.

Example
-------
>>> import cpattn
>>> from cpattn.engine.blocks import BlockManager
>>> from cpattn.engine.runner_hybrid import HybridStepRunner
>>> from cpattn.engine.scheduler import Scheduler
>>> from cpattn.models import qwen3_next as qn
>>> cfg = qn.Qwen3NextConfig.tiny()
>>> params = qn.init_params(cfg)
>>> def rank(g):
...     s = Scheduler(BlockManager(8, 4, dcp_size=g.size, enable_caching=False), max_num_batched_tokens=5,
...                   max_num_seqs=2)
...     run = HybridStepRunner(g, "qwen3_next", params, cfg, num_blocks=8, block_size=4, max_model_len=32,
...                            pcp_size=2)
...     rid = s.add_request(list(range(1, 12)), max_tokens=3)   # 11 tokens: chunks of 5, 5, 1
...     pcp = 0
...     while s.has_unfinished():
...         res = run.execute(s.schedule())
...         s.update(res.outputs)
...         pcp += res.pcp_rows
...     return s.output_tokens(rid), run.pcp_group is None, pcp
>>> out = cpattn.simulate(4, rank)
>>> len({tuple(t) for t, *_ in out}), [o[1] for o in out], out[0][2]
(1, [False, False, True, True], 3)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cpattn.engine.backends.hybrid import hybrid_prefill
from cpattn.engine.backends.paged import handoff as paged_handoff
from cpattn.engine.batch import Prompts
from cpattn.engine.handoff import exchange, place_rows
from cpattn.engine.kv_rows import row_width
from cpattn.engine.prefill_steps import Prefix
from cpattn.engine.runner_pcp import cached_rows, from_rank0, outputs_from_rank0
from cpattn.engine.sampling import choose, sampled_positions
from cpattn.engine.scheduler import ModelOutput, SchedulerOutput
from cpattn.layout.pcp import pcp_plan
from cpattn.layout.rows import cu_seqlens
from cpattn.linear.state import RecurrentCache


def pcp_group(group, pcp_size: int):
    """The group a hybrid runner's PCP chunks run over: ``group`` (``pcp_size`` 1 or ``group.size``), or its
    first ``pcp_size`` ranks (None on the others). Every rank of ``group`` calls it (a split is collective)."""
    return group if pcp_size in (1, group.size) else group.split(range(pcp_size))


def _from_rank0_states(group, got: RecurrentCache | None, like: RecurrentCache) -> RecurrentCache:
    """DCP rank 0's states ``got`` on every rank (shapes and dtypes those of ``like``): one message per kind."""
    parts = []
    for kind in ("conv", "state"):
        ref = getattr(like, kind)
        flat = None if got is None else torch.cat([t.to(r.dtype).reshape(-1) for t, r in zip(getattr(got, kind), ref)])
        if not ref:
            parts.append(())
            continue
        flat = from_rank0(group, flat)
        parts.append(tuple(x.view(r.shape) for x, r in zip(flat.split([r.numel() for r in ref]), ref)))
    return RecurrentCache(*parts)


def pcp_chunks(runner, out: SchedulerOutput):
    """The step's prefill chunks under PCP (every row a prefill; module docstring), on every DCP rank.
    Returns ({req_id: ModelOutput}, {req_id: logits [1, V]}, {req_id: {name: [q, H]}} every new row's hidden
    states, or None without ``hidden_layers``)."""
    # w: the engine's world (the DCP group, or wider: runner_wide), its first n ranks the DCP group g (None on
    # the others); pg: the PCP group (None on a DCP rank outside a PCP sub-group)
    w, g, pg, n = runner.world, runner.group, runner.pcp_group, runner.dcp_size
    table = runner.batch(out, max(len(ids) for ids in out.block_tables))["block_table"]
    view = replace(runner.shard, block_table=table)
    ctx = tuple(out.context_lens)
    prefix = Prefix(cached_rows(w, view, ctx, n), ctx)
    prompts = Prompts.of([[0] * c + list(ids) for c, ids in zip(ctx, out.input_ids)],
                         vocab_size=runner.cfg.vocab_size)
    slots = torch.tensor([runner.slots[r] for r in out.req_ids], dtype=torch.int64)
    keep = torch.tensor([c > 0 for c in ctx])

    def take(t):
        if g is None:  # outside the DCP group: no states (DCP rank 0's below)
            return torch.zeros(len(slots), *t.shape[1:], dtype=t.dtype)
        x = t[slots]
        return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype))

    init = RecurrentCache(tuple(map(take, runner.states.conv)), tuple(map(take, runner.states.state)))
    if w is not g and any(ctx):  # PCP wider than the DCP group: every PCP rank starts from DCP rank 0's states
        init = _from_rank0_states(w, init, init)
    chunks = runner.chunk_logits  # a dict while the runner hands back prompt logits
    res = None if pg is None else hybrid_prefill(pg, runner.family, runner.params, runner.cfg, prompts,
                                                 algorithms=runner.algorithms, prefix=prefix, states=init,
                                                 hidden_layers=runner.hidden_layers, prompt_logits=chunks is not None)
    if pg is g:
        paged_handoff(g, g, g, view, res, runner.algorithms)
        states, first, full, hid = res.states, res.first_logits, res.prompt_logits, res.hidden
    else:  # a sub-group or a wider world: the rows to their DCP owners over the world
        plan = pcp_plan(cu_seqlens(out.query_lens), runner.pcp_size, context_lens=ctx) if res is None else res.plan
        width = row_width(view.layouts)
        got, req, pos, _ = exchange(w, None if res is None else res.rows, plan, pcp_size=runner.pcp_size,
                                    dcp_size=n, interleave_size=view.interleave_size, width=width,
                                    dtype=prefix.rows.dtype, method=runner.algorithms.handoff)
        if g is not None:
            place_rows(view, got, req, pos, rank=w.rank, dcp_size=n)
    if pg is w and pg is not g:  # a wider world: every rank ran the chunks, its own states and outputs
        states, first, full, hid = res.states, res.first_logits, res.prompt_logits, res.hidden
    elif pg is not g:  # a sub-group: DCP rank 0's states and outputs to every DCP rank
        states = _from_rank0_states(g, None if res is None else res.states, init)
        first, full, hid = outputs_from_rank0(g, *(3 * [None] if res is None else
                                                   [res.first_logits, res.prompt_logits, res.hidden]),
                                              prompt_logits=chunks is not None, hidden_layers=runner.hidden_layers)
    for dst, src in zip((*runner.states.conv, *runner.states.state), (*states.conv, *states.state)):
        if g is not None:  # outside the DCP group (runner_wide): no slot states to keep
            dst[slots] = src.to(dst.dtype)
    chosen = first.argmax(-1).tolist()  # first: [B, V]
    if any(out.sampling):  # None: a greedy row
        chosen = choose(first, chosen, sampled_positions(out, last_only=True))
    outputs, logits = {}, {}
    hidden, cu = (None if hid is None else {}), cu_seqlens(out.query_lens)
    for b, rid in enumerate(out.req_ids):
        outputs[rid] = ModelOutput((chosen[b],)) if out.samples[b] else ModelOutput()
        if out.samples[b]:
            logits[rid] = first[b:b + 1]
        if hidden is not None:  # request order, the new rows only
            hidden[rid] = {n: h[cu[b]:cu[b + 1]] for n, h in hid.items()}
        if chunks is not None:  # [q, V] request order, the new rows only
            chunks[rid] = full[cu[b]:cu[b + 1]]
    return outputs, logits, hidden
