"""Data-parallel prefill of short chunks under elastic CP: each short prompt runs on one rank, at the same time.

With ``pcp_policy="elastic"`` a chunk shorter than ``pcp_min_tokens`` (counting its context's attention:
:func:`~cpattn.engine.elastic.runs_pcp`) does not pay for PCP. Run as DCP
attention with the step's decodes, every rank would compute every one of its tokens (and merge partial
attention each layer). Instead the group splits a step's short chunks, one rank each -- a lone one too
(then one rank computes it while the others wait: on the 2-core test machine a lone 64-256-token prompt's
first token came in 0.57x [0.22-1.32] the time of the DCP path, 30 interleaved rounds on 2 gloo ranks):

- a chunk that continues cached context (a prefix hit, or a prompt's later chunk) needs that context on
  the rank that computes it: each rank contributes the context rows it owns and one all-reduce puts them
  on every rank (:func:`~cpattn.engine.runner_pcp.cached_rows`, as a PCP chunk gathers its context);
- :func:`assign` gives each chunk one rank, longest first to the least-loaded rank (ties to the lower rank,
  then the earlier chunk): host-side, the same on every rank;
- each rank runs plain one-device :func:`~cpattn.engine.prefill.prefill` over its own chunks (a size-1
  :class:`Solo` group), attending their context;
- the new KV rows go to their DCP owners as after a prefill (:func:`~cpattn.engine.handoff.exchange`,
  ``Algorithms.handoff``: one all-to-all of each rank's rows by owner, or an all-gather), and each rank
  writes those it owns into its shard (:func:`~cpattn.engine.handoff.place_rows`): decode keeps the DCP
  layout;
- one all-gather of the chunks' last-row logits, so every rank picks the same tokens from the same logits
  (greedy and seeded sampling alike), those of one device.

The step's other rows (long chunks under PCP, decodes) run first through the ordinary
:meth:`~cpattn.engine.runner.StepRunner.execute`. Hybrid runners (per-request linear states) and runners
that return hidden states keep today's path.

>>> assign([5, 3, 3, 2], 2)
[0, 1, 1, 0]
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from cpattn.comm.group import Group
from cpattn.engine.batch import Prompts
from cpattn.engine.handoff import exchange, place_rows
from cpattn.engine.kv_rows import row_width
from cpattn.engine.prefill import gather_unshard, prefill
from cpattn.engine.prefill_steps import Prefix
from cpattn.engine.runner_pcp import cached_rows, rows_of
from cpattn.engine.sampling import choose, sampled_positions
from cpattn.engine.scheduler import ModelOutput, SchedulerOutput
from cpattn.layout.rows import cu_seqlens
from cpattn.ops.ref import acc_dtype


class Solo(Group):
    """A group of one rank (rank 0): every collective is the identity, counted as sending nothing."""

    rank, size = 0, 1

    def _unreachable(self, *_):  # Group's public collectives return before calling these when size == 1
        raise AssertionError("Solo is a group of one rank; no collective reaches its transport")

    _all_gather = _reduce_scatter = _all_to_all = _all_reduce = _ring_start = _unreachable


@dataclass
class DPStats:
    """This rank's data-parallel prefill counters: ``steps`` that ran one, ``chunks`` and their new
    ``tokens`` (over the group), ``bytes_sent`` by this rank for the rows' exchange and the logits all-gather."""

    steps: int = 0
    chunks: int = 0
    tokens: int = 0
    bytes_sent: int = 0


@dataclass(frozen=True)
class DPPlan:
    """Which rank prefilled which new tokens (what :func:`~cpattn.engine.handoff.exchange` reads of a plan):
    ``cu_seqlens`` [B+1]; per rank ``token_index[r]`` [T_r] packed ids (its chunks, in order), ``positions[r]``
    [T_r], ``num_tokens[r]`` T_r."""

    cu_seqlens: torch.Tensor
    token_index: tuple
    positions: tuple
    num_tokens: tuple


def assign(lens, size: int) -> list[int]:
    """The rank of each chunk of ``lens`` new tokens: longest first to the least-loaded of ``size`` ranks."""
    load, owner = [0] * size, [0] * len(lens)
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + lens[i]
    return owner


def dp_rows(runner, out: SchedulerOutput) -> list[int]:
    """The rows of ``out`` to prefill data-parallel (module docstring), or [] (then the step runs as before)."""
    if not (runner.pcp_size > 1 and runner.pcp_min_tokens > 0) or runner.other_caches or runner.hidden_layers is not None:
        return []
    if getattr(runner, "world", runner.group) is not runner.group:  # PCP wider than DCP: short chunks join the decodes
        return []
    pcp = set(runner.pcp_rows(out))
    return [b for b, p in enumerate(out.is_prefill) if p and b not in pcp and not out.draft_tokens[b]]


def execute_with_dp(runner, out: SchedulerOutput, dp: list[int]):
    """Run the step: rows not in ``dp`` through ``runner.execute``, then rows ``dp`` data-parallel; one StepResult."""
    from cpattn.engine.runner import StepResult

    g = runner.group
    keep = set(dp)
    graph, runner.graph = runner.graph, None  # the whole step is not a uniform decode: the rest runs eagerly
    try:
        res = runner.execute(rows_of(out, [b for b in range(len(out.req_ids)) if b not in keep]))
    finally:
        runner.graph = graph
    runner.pcp_context.clear()  # kept PCP contexts: only across steps that are PCP steps
    sent, t0 = g.stats.total_sent(), time.perf_counter()
    sub = rows_of(out, dp)
    table = runner.batch(sub, max(len(ids) for ids in sub.block_tables))["block_table"]
    view = dataclasses.replace(runner.shard, block_table=table)
    owner = assign(sub.query_lens, g.size)
    mine = [i for i, r in enumerate(owner) if r == g.rank]
    layouts, vocab = runner.shard.layouts, runner.cfg.vocab_size
    width, dtype = row_width(layouts), runner.shard.k[0].dtype
    ctx = tuple(sub.context_lens)
    context = cached_rows(g, view, ctx) if any(ctx) else None  # [sum ctx, F] on every rank: one all-reduce
    t1 = time.perf_counter()
    if mine:
        solo, cu_c = Solo(), cu_seqlens(ctx)
        mine_ctx = tuple(ctx[i] for i in mine)
        prefix = None if not any(mine_ctx) else Prefix(torch.cat([context[cu_c[i]:cu_c[i + 1]] for i in mine]),
                                                        mine_ctx)
        got = prefill(solo, runner.family, runner.params, runner.cfg,
                      Prompts.of([[0] * ctx[i] + list(sub.input_ids[i]) for i in mine], vocab_size=vocab),
                      algorithms=runner.algorithms, prefix=prefix)
        rows, first = gather_unshard(solo, got.rows, got.plan), got.first_logits  # [T_r, F], [B_r, V]
    else:
        rows = torch.zeros(0, width, dtype=dtype)
        first = torch.zeros(0, vocab, dtype=acc_dtype(torch.zeros(0, dtype=dtype)))
    t2 = time.perf_counter()
    counts = [owner.count(j) for j in range(g.size)]
    cu, index, positions = [0], [[] for _ in range(g.size)], [[] for _ in range(g.size)]
    for q, c, r in zip(sub.query_lens, ctx, owner):
        index[r].append(torch.arange(cu[-1], cu[-1] + q))
        positions[r].append(torch.arange(c, c + q))  # the chunk's new tokens, after its cached context
        cu.append(cu[-1] + q)
    join = lambda ts: torch.cat(ts) if ts else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    plan = DPPlan(torch.tensor(cu), tuple(map(join, index)), tuple(map(join, positions)),
                  tuple(sum(t.numel() for t in ts) for ts in index))
    new, req, pos, _ = exchange(g, rows, plan, pcp_size=g.size, dcp_size=g.size,
                                interleave_size=runner.shard.interleave_size, width=width, dtype=dtype,
                                method=runner.algorithms.handoff)  # each rank receives the rows it owns
    b_max = max(counts)
    pad = torch.nn.functional.pad
    all_first = g.all_gather(pad(first, (0, 0, 0, b_max - first.shape[0]))).view(g.size, b_max, -1)
    seen, last = [0] * g.size, []
    for r in owner:
        last.append(all_first[r, seen[r]])
        seen[r] += 1
    place_rows(view, new, req, pos, rank=g.rank, dcp_size=g.size)
    first = torch.stack(last)  # [B, V], chunk order
    chosen = first.argmax(-1).tolist()
    if any(sub.sampling):  # None: a greedy row
        chosen = choose(first, chosen, sampled_positions(sub, last_only=True))
    outputs, logits = dict(res.outputs), dict(res.logits)
    for i, rid in enumerate(sub.req_ids):
        if sub.samples[i]:
            outputs[rid] = ModelOutput((chosen[i],))
            logits[rid] = first[i:i + 1]
        else:
            outputs[rid] = ModelOutput()
    moved = g.stats.total_sent() - sent
    st = runner.dp_stats
    st.steps, st.chunks, st.tokens, st.bytes_sent = (st.steps + 1, st.chunks + len(dp),
                                                     st.tokens + sum(sub.query_lens), st.bytes_sent + moved)
    t3 = time.perf_counter()
    return StepResult(outputs, logits, False, res.bytes_sent + moved, res.prepare_s + t1 - t0,
                      res.forward_s + t2 - t1 + t3 - t2, res.sample_s, res.pcp_rows, res.hidden)
