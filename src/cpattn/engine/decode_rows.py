"""The scheduler's fast paths for a step of one-token decodes (no drafts) -- the common step of a serving
loop: :func:`decode_output` builds its :class:`~cpattn.engine.scheduler.SchedulerOutput` and
:func:`commit_one_each` commits its sampled tokens, with less per-row Python than the general code of
:class:`~cpattn.engine.scheduler.Scheduler` (``_output`` / ``update``), whose results they equal
(tests/test_scheduler_fast_commit.py compares the two over drawn schedules).

A decode row is ``(request, context, 1, no drafts)`` whose context is every token but the last and whose
tokens hold output. When the rows are the previous such step's requests, the fields that depend only on
the request set -- query lengths, drafts, prefill flags, sampled flags, loads, sampling parameters -- are
that step's tuples, reused (vLLM's persistent batch keeps them the same way; the code is ours).

Example
-------
>>> from cpattn.engine.blocks import BlockManager
>>> from cpattn.engine.scheduler import ModelOutput, Scheduler
>>> s = Scheduler(BlockManager(8, 4), max_num_batched_tokens=8, max_num_seqs=2)
>>> a = s.add_request([1, 2, 3], max_tokens=4)
>>> _ = s.schedule(), s.update({a: ModelOutput([7])})   # the prompt (the general code)
>>> out = s.schedule()                                   # a decode: built here
>>> out.input_ids, out.context_lens, out.is_prefill, out is s._last_decode
(((7,),), (3,), (False,), True)
>>> commit_one_each(s, out, [9]), s.output_tokens(a)
([], [7, 9])
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from cpattn.engine.step_types import SchedulerOutput

_new = object.__new__  # a SchedulerOutput from another's fields, as its __init__ leaves them (no __post_init__)


def decode_output(sched, rows: list, preempted: list):
    """The step's SchedulerOutput when every row of ``rows`` ((request, context, new tokens, drafts)) is a
    one-token decode; None otherwise (the scheduler then builds it in general)."""
    if not rows:
        return None
    ids, ctxs, inputs, num_output = [], [], [], []
    for r, c, n, d in rows:
        toks = r.tokens
        if n != 1 or d or c != len(toks) - 1 or c < r.num_prompt or r.loads:
            return None
        ids.append(r.req_id)
        ctxs.append(c)
        inputs.append((toks[c],))
        num_output.append(c + 1 - r.num_prompt)
    ids, prev, b = tuple(ids), sched._last_decode, len(ids)
    if prev is not None and prev.req_ids == ids:
        same = (prev.query_lens, prev.draft_tokens, prev.is_prefill, prev.samples, prev.loads, prev.sampling)
    else:
        same = ((1,) * b, ((),) * b, (False,) * b, (True,) * b, ((),) * b, tuple([row[0].sampling for row in rows]))
    finished, sched._finished_since = tuple(sched._finished_since), []
    out = SchedulerOutput(
        req_ids=ids, query_lens=same[0], context_lens=tuple(ctxs), seq_lens=tuple([c + 1 for c in ctxs]),
        block_tables=tuple(map(sched.blocks.table_ids, ids)), input_ids=tuple(inputs), draft_tokens=same[1],
        is_prefill=same[2], samples=same[3], preempted=tuple(preempted), finished=finished,
        fresh_blocks=tuple(sched.blocks.take_fresh()), loads=same[4], sampling=same[5], num_output=tuple(num_output))
    sched._last_decode, sched._last_changes = out, sched.blocks.changes
    return out


def steady_output(sched):
    """The step's SchedulerOutput when it is the previous decode step again, one token on; None otherwise
    (nothing changed: the scheduler then schedules in general).

    That is: :func:`commit_one_each` committed the previous step -- one built here or by
    :func:`decode_output` -- with every row running and none finished (so each of its requests now has
    exactly its sampled token to compute, no drafts, no loads), no request left the running list since
    (an abort clears the mark), all of them fit the budget and no admission can follow (no waiting request,
    or the budget or the sequence cap used up). Each field follows from the previous step's: contexts are
    its sequence lengths, inputs the tokens just committed. Block ids are allocated only for the rows whose
    token starts a new span (all or nothing: if the free list is short, the general code preempts), and the
    block tables are the previous step's tuple when no table changed since.
    """
    prev, sched._steady = sched._steady, None
    running, blocks = sched.running, sched.blocks
    if prev is None or blocks.dcp_rank:  # blocks_for below is rank 0's ceil(S / span)
        return None
    ids, budget = prev.req_ids, sched.max_num_batched_tokens
    n = len(ids)
    if n != len(running) or n > budget or (sched.waiting and n < budget and n < sched.max_num_seqs):
        return None
    ctxs, span = prev.seq_lens, blocks.span
    grow = [(rid, c + 1) for rid, c in zip(ids, ctxs) if not c % span]  # token c starts span c // span
    if grow and not blocks.allocate_each(grow):
        return None
    out = _new(SchedulerOutput)
    d = out.__dict__
    d.update(prev.__dict__)  # the fields that depend on the request set only
    d["eager_reason"] = None  # the cached property's value: every row a one-token decode
    d["context_lens"], d["seq_lens"] = ctxs, tuple([c + 1 for c in ctxs])
    d["input_ids"] = tuple(zip(sched._committed))  # (t,) a row
    d["num_output"] = tuple([k + 1 for k in prev.num_output])
    d["block_tables"] = prev.block_tables if blocks.changes == sched._last_changes else \
        tuple(map(blocks.table_ids, ids))
    d["preempted"], d["fresh_blocks"] = (), tuple(blocks.take_fresh())
    d["finished"], sched._finished_since = tuple(sched._finished_since), []
    sched._last_decode, sched._last_changes = out, blocks.changes
    return out


def commit_one_each(sched, step, tokens: Sequence[int]) -> list[Hashable]:
    """``Scheduler.update`` of a step whose every row sampled ``tokens[b]`` and verified no draft (the same
    commit, row by row, with nothing to validate and no block to give back); the requests that finished."""
    sched._pending, done, blocks, requests = None, [], sched.blocks, sched.requests
    caching, span, skipped = blocks.enable_caching, blocks.span, False
    for rid, seq_len, t in zip(step.req_ids, step.seq_lens, tokens):
        req = requests[rid]
        if req.status != "running":  # aborted since the step was scheduled
            skipped = True
            continue
        req.num_computed = seq_len
        toks = req.tokens
        toks.append(t)
        if caching:
            if len(toks) // span > len(req.keys):
                blocks.extend_keys(req.keys, toks)
            blocks.cache_blocks(rid, req.keys, seq_len)
        if t in req.stop_token_ids or len(toks) - req.num_prompt >= req.max_tokens:  # finished
            sched.running.remove(req)
            sched._finish(req, "stop" if t in req.stop_token_ids else "length")
            done.append(rid)
        elif req.drafts:
            req.drafts = []
        # no trim: this step's schedule grew the table to blocks_for(seq_len) from at most blocks_for(context)
        # (every update leaves a table no longer than its computed tokens need), so nothing lies past it
    if not done and not skipped and step is sched._last_decode:  # the next step may be this one again
        sched._steady, sched._committed = step, tuple(tokens)
    return done
