"""A step's prefill chunks under PCP: the chunk rows split head-tail over the group, the cached context
gathered from the DCP-sharded cache, the new rows sent straight to the DCP ranks that own them.

The chunks run over the :class:`~cpattn.engine.runner.StepRunner`'s PCP group (``runner.pcp_group``): its
DCP group (one engine with ``pcp_size = dcp_size``, the guide's PCP + DCP layout), or the first
``pcp_size`` ranks of it (``1 < pcp_size < dcp_size``), or the engine's whole world when wider than the DCP
group (``pcp_size > dcp_size``, :mod:`cpattn.engine.runner_wide`: ranks past the DCP group hold no cache, add
nothing to a gathered context, receive no rows). A step then runs twice: its prefill rows through
:func:`cpattn.engine.prefill.prefill` over the PCP group (PCP ring attention, or DSA-CP for a DSA model,
over the chunk with its cached context as a :class:`~cpattn.engine.prefill_steps.Prefix`), the new rows
sent to their DCP owners over the whole DCP group; its decode rows through the ordinary DCP step. Each
request's context rows are read where this rank owns them and summed over the DCP group (each row has
one owner), so every rank holds the prefix the chunk attends. A DCP rank outside a PCP sub-group computes
none of the chunks' rows: it knows the split (host-side), sends no rows, receives those it owns, and gets
the logits (and hidden states) from DCP rank 0, so every rank samples the same tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from cpattn.engine.backends.paged import request_order
from cpattn.engine.batch import Prompts
from cpattn.engine.kv_rows import pack_rows, row_width
from cpattn.engine.options import Algorithms
from cpattn.engine.handoff import exchange, place_rows
from cpattn.engine.prefill import gather_unshard, prefill, split_plan
from cpattn.engine.prefill_steps import Prefix
from cpattn.engine.sampling import choose, sampled_positions
from cpattn.engine.scheduler import ModelOutput, SchedulerOutput
from cpattn.layout.rows import cu_seqlens, request_of


def rows_of(out: SchedulerOutput, keep: list[int]) -> SchedulerOutput:
    """The step restricted to rows ``keep`` (request-level tuples filtered; preempted/finished kept)."""
    pick = {f.name: tuple(getattr(out, f.name)[b] for b in keep) for f in dataclasses.fields(out)
            if f.name not in ("preempted", "finished", "fresh_blocks")}
    return dataclasses.replace(out, **pick)


def cached_rows(group, shard, context_lens: tuple[int, ...], dcp_size: int | None = None) -> torch.Tensor:
    """Rows [sum(context_lens), F] of each request's first ``context_lens[b]`` tokens, on every rank.

    ``shard.block_table`` holds the requests' tables; a rank contributes the rows it owns (zeros elsewhere)
    and an all-reduce over ``group`` puts them together. ``dcp_size``: the DCP group is the group's first
    ``dcp_size`` ranks (default all of them); a rank past it holds no cache and contributes zeros."""
    total = sum(context_lens)
    width = row_width(shard.layouts)
    dtype = shard.k[0].dtype
    if total == 0:
        return torch.zeros(0, width, dtype=dtype)
    n = group.size if dcp_size is None else dcp_size
    if group.rank >= n:  # outside the DCP group (runner_wide): nothing of its own to add
        return group.all_reduce(torch.zeros(total, width, dtype=dtype))
    cu = cu_seqlens(context_lens)
    req = request_of(cu)  # [total]
    pos = torch.arange(total) - torch.tensor(cu[:-1])[req]
    slots = shard.slots(pos, req, group.rank, n)  # [total], -1 where another rank owns it
    mine = slots >= 0
    safe = torch.where(mine, slots, torch.zeros_like(slots))

    def flat(t):
        return None if t is None else t.view(-1, *t.shape[2:])[safe]

    rows = pack_rows(shard.layouts, [flat(k) for k in shard.k], [flat(v) for v in shard.v],
                     [flat(ki) for ki in shard.k_index])  # [total, F]
    rows = torch.where(mine[:, None], rows, torch.zeros_like(rows))
    return group.all_reduce(rows)


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64)  # int64: a step's argmax


def from_rank0(group, x: torch.Tensor | None) -> torch.Tensor:
    """DCP rank 0's tensor ``x`` on every rank of ``group`` (``x`` None on the others, which need not know its
    shape): a header all-reduce (shape, dtype), then rank 0's values summed with zeros, bit for bit."""
    head = torch.zeros(6, dtype=torch.int64)  # [dtype, ndim, *shape (up to 4 dims)]
    if group.rank == 0:
        head[0], head[1] = _DTYPES.index(x.dtype), x.dim()
        head[2:2 + x.dim()] = torch.tensor(x.shape)
    head = group.all_reduce(head).tolist()
    shape = tuple(head[2:2 + head[1]])
    mine = x.contiguous() if group.rank == 0 else torch.zeros(shape, dtype=_DTYPES[head[0]])
    return group.all_reduce(mine)


def outputs_from_rank0(group, first, full, hidden, *, prompt_logits: bool, hidden_layers):
    """DCP rank 0's prefill outputs on every rank of ``group`` (None on a rank outside a PCP sub-group):
    (first logits [B, V], every row's logits [T, V] with ``prompt_logits`` else ``full`` as given, hidden
    states ``{name: [T, ...]}`` with ``hidden_layers`` (the forward's keys: these layers, then "norm") else
    ``hidden``). Every rank passes the same flags."""
    first = from_rank0(group, first)
    if prompt_logits:
        full = from_rank0(group, full)
    if hidden_layers is not None:
        names = [*sorted({i for i in hidden_layers if i != "norm"}), "norm"]
        hidden = {n: from_rank0(group, None if hidden is None else hidden[n]) for n in names}
    return first, full, hidden


def run_prefill_rows(runner, out: SchedulerOutput, table: torch.Tensor, algorithms: Algorithms):
    """PCP prefill of the step's (all-prefill) rows; returns ({req_id: ModelOutput}, {req_id: logits [1, V]},
    {req_id: {name: [q, F]}} hidden states of every row, or None without ``runner.hidden_layers``).

    When a prefill continues past this step, the new rows are all-gathered (request order) once: each rank
    writes those it owns into its shard, and a request whose prefill continues keeps them, after its
    context, in ``runner.pcp_context``
    (``{req_id: rows [n, F]}``, every rank the same), so its next chunk attends that context without
    gathering it from the DCP shards again (:func:`cached_rows`, the fallback whenever a request's
    context is not exactly the rows kept: after a preemption, a prefix hit, or a chunk run without PCP)."""
    # g: the engine's world (the DCP group, or the PCP group when wider: runner_wide), its first n ranks the DCP
    # group; pg: the PCP group (None on a DCP rank outside a PCP sub-group)
    g, pg, n = runner.world, runner.pcp_group, runner.dcp_size
    owner = g.rank < n  # holds a cache: writes the rows it owns
    view = dataclasses.replace(runner.shard, block_table=table)
    ctx = tuple(out.context_lens)
    kept = runner.pcp_context
    if all(c == 0 or (rid in kept and kept[rid].shape[0] == c) for rid, c in zip(out.req_ids, ctx)):
        held = [kept[rid] for rid, c in zip(out.req_ids, ctx) if c]
        rows = torch.cat(held) if held else cached_rows(g, view, ctx, n)  # no context at all: no gather
    else:
        rows = cached_rows(g, view, ctx, n)
    prefix = Prefix(rows, ctx)
    vocab = runner.cfg.vocab_size
    prompts = Prompts.of([[0] * c + list(ids) for c, ids in zip(ctx, out.input_ids)], vocab_size=vocab)
    chunks = getattr(runner, "chunk_logits", None)  # a dict while the runner hands back prompt logits
    res = None if pg is None else prefill(pg, runner.family, runner.params, runner.cfg, prompts,
                                          algorithms=algorithms, prefix=prefix, hidden_layers=runner.hidden_layers,
                                          prompt_logits=chunks is not None)
    kept.clear()  # only requests whose prefill goes on, with exactly the context their cache holds
    cu, cu_c = cu_seqlens(out.query_lens), cu_seqlens(ctx)
    plan = split_plan(runner.family, cu, runner.pcp_size, algorithms=algorithms, context_lens=ctx) if res is None \
        else res.plan  # outside the PCP group: the same split, host-side
    mine = torch.zeros(0, rows.shape[1], dtype=rows.dtype) if res is None else res.rows  # [T_r, F], plan order
    if all(out.samples):  # every prefill completes: rows straight to their owners (Algorithms.handoff), none kept
        got, req, pos, _ = exchange(g, mine, plan, pcp_size=runner.pcp_size, dcp_size=n,
                                    interleave_size=view.interleave_size, width=rows.shape[1], dtype=rows.dtype,
                                    method=algorithms.handoff)
        if owner:
            place_rows(view, got, req, pos, rank=g.rank, dcp_size=n)
    else:
        new = gather_unshard(g, mine, plan)  # [T, F] request order, on every rank (ranks past the plan's: none)
        req, pos = request_order(plan, new.shape[0], ctx)
        if owner:
            place_rows(view, new, req, pos, rank=g.rank, dcp_size=n)
        for b, rid in enumerate(out.req_ids):
            if not out.samples[b]:
                kept[rid] = torch.cat([rows[cu_c[b]:cu_c[b + 1]], new[cu[b]:cu[b + 1]]])
    first, full, hid = (None, None, None) if res is None else (res.first_logits, res.prompt_logits, res.hidden)
    if pg is not g:  # a PCP sub-group: DCP rank 0's (a PCP rank's) logits and hidden states on every rank
        first, full, hid = outputs_from_rank0(g, first, full, hid, prompt_logits=chunks is not None,
                                             hidden_layers=runner.hidden_layers)
    chosen = first.argmax(-1).tolist()
    if any(out.sampling):  # None: a greedy row
        chosen = choose(first, chosen, sampled_positions(out, last_only=True))
    outputs, logits = {}, {}
    hidden = None if hid is None else {}
    for b, rid in enumerate(out.req_ids):
        if chunks is not None:  # [T_new, V] request order
            chunks[rid] = full[cu[b]:cu[b + 1]]
        if hidden is not None:  # request order, the new rows only
            hidden[rid] = {n: h[cu[b]:cu[b + 1]] for n, h in hid.items()}
        if out.samples[b]:
            outputs[rid] = ModelOutput((chosen[b],))
            logits[rid] = first[b:b + 1]
        else:
            outputs[rid] = ModelOutput()
    return outputs, logits, hidden
