"""The model runner of the step loop: one rank's paged KV cache, and one step over a scheduled batch.

A :class:`~cpattn.engine.scheduler.SchedulerOutput` names, per row, the
``query_lens[b]`` tokens to compute on top of ``context_lens[b]`` cached
ones and the block ids that cover them. The runner turns it into the
tensors of :func:`cpattn.engine.decode.decode_step` -- tokens [T], seq_lens
[B], block_table [B, max_blocks] (padded with the spare block, which stays
NaN), cu_seqlens_q [B+1] -- and runs that one step function:

- a prefill chunk is a query of many rows at positions ``context ..
  seq_len - 1``: it writes its KV where owned and attends, causally, to
  its cached context and to itself through DCP attention (each rank its
  shard of the keys, partials merged by LSE), so a chunk never recomputes
  the context before it;
- a decode is a query of ``1 + d`` rows (the last token and d drafts);
- a step whose rows are all decodes of ``1 + k`` tokens (``uniform_decode``,
  every request with its k drafts) replays a captured program when the
  runner has one (FULL_DECODE_ONLY); any other step -- a prefill chunk,
  a mix, drafts cut short by ``max_tokens`` -- runs the same function eagerly.

Sampling: each request's :class:`~cpattn.engine.sampling.SamplingParams` come in
``SchedulerOutput.sampling``; greedy rows take the step's argmax (ties to the lowest token id),
sampled rows (temperature > 0) the token of :mod:`cpattn.engine.sampling` at each position (a pure
function of the logits, the request's seed and the output index, so every DCP rank picks the
same). A sampled row emits the accepted drafts then the bonus token: the greedy rule of
:func:`~cpattn.engine.decode.accept_drafts` on the picked tokens, which for sampled rows is
rejection sampling (:func:`cpattn.engine.sampling.verify`). A step whose rows are all greedy runs
no sampling code.
With ``poison=True`` every block the block manager hands out anew is
filled with NaN before the step writes it, so a read of stale rows shows.

Example
-------
>>> import cpattn
>>> from cpattn.engine.blocks import BlockManager
>>> from cpattn.engine.scheduler import Scheduler
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config.tiny()
>>> params = qwen3.init_params(cfg)
>>> def rank(g):
...     s = Scheduler(BlockManager(8, 4, dcp_size=g.size), max_num_batched_tokens=8, max_num_seqs=2)
...     run = StepRunner(g, "qwen3", params, cfg, num_blocks=8, block_size=4, max_model_len=32)
...     rid = s.add_request([1, 2, 3], max_tokens=3)
...     while s.has_unfinished():
...         s.update(run.execute(s.schedule()).outputs)
...     return s.output_tokens(rid)
>>> a, b = cpattn.simulate(2, rank)
>>> a == b, len(a)
(True, 3)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.engine.decode import decode_step, step_fields
from cpattn.engine.elastic import runs_pcp
from cpattn.engine.options import Algorithms
from cpattn.engine.paged_cache import PagedShard
from cpattn.engine.sampling import choose, sampled_positions
from cpattn.engine.runner_pcp import rows_of, run_prefill_rows
from cpattn.engine import runner_dp, runner_wide
from cpattn.engine.scheduler import ModelOutput, SchedulerOutput
from cpattn.engine.step_inputs import BlockTableRows, HostInts, LogitRows, OneTokenRows, flat, int64
from cpattn.graphs.runner import DecodeRunner
from cpattn.layout.rows import cu_seqlens
from cpattn.models.family import ModelFamily, get_family, nan_caches, param_dtype
from cpattn.dcp.layer_merges import ENGINE_MERGE


_NOTHING = ModelOutput()  # a partial chunk's row: nothing sampled


@dataclass(frozen=True)
class StepResult:
    """One executed step: ``outputs[req_id]`` for the scheduler's update; ``logits[req_id]`` [n, V]
    the rows each sampled token came from (float32, float64 in a float64 run); ``replayed``: the step
    ran a captured program; ``bytes_sent``: what this rank sent during the step; ``prepare_s`` /
    ``forward_s`` / ``sample_s``: host seconds building the inputs, running the step, picking tokens;
    ``pcp_rows``: prefill rows that ran PCP (0 when the chunks ran DCP attention); ``hidden[req_id]``:
    with ``hidden_layers``, ``{name: [n, F]}`` the target's hidden states of the row's final positions
    (a chunk's every row; a decode's last token and accepted drafts), what a drafter reads next;
    ``chunk_logits[req_id]``: with the runner's ``prompt_logits`` on, [q, V] the logits of every row of
    each prefill row (its chunk, positions ``context .. context + q - 1``), else None."""

    outputs: dict
    logits: dict
    replayed: bool
    bytes_sent: int
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    pcp_rows: int = 0
    hidden: dict | None = None
    chunk_logits: dict | None = None


def check_pcp_size(pcp_size: int, group: Group, who: str, *, sub_group: bool = False) -> int:
    """A runner's ``pcp_size``: 1 (prefill chunks run DCP attention) or ``group.size`` (PCP over the DCP group);
    with ``sub_group`` (StepRunner) any size up to ``group.size`` (PCP over the group's first ``pcp_size`` ranks).
    Any other size is a ValueError. Returns it as an int.

    >>> from cpattn.comm.sim import SimMesh
    >>> check_pcp_size(2, SimMesh(2).groups()[0], "StepRunner"), check_pcp_size(1, SimMesh(2).groups()[0], "x")
    (2, 1)
    >>> check_pcp_size(2, SimMesh(4).groups()[0], "StepRunner", sub_group=True)
    2
    """
    if sub_group and not isinstance(pcp_size, bool) and 1 <= int(pcp_size) <= group.size:
        return int(pcp_size)
    if isinstance(pcp_size, bool) or int(pcp_size) not in (1, group.size):
        if sub_group:
            raise ValueError(f"{who}(pcp_size={pcp_size!r}) with a group of {group.size}: PCP runs over the first "
                             f"pcp_size ranks of the DCP group; pass pcp_size in 1..{group.size}")
        raise ValueError(f"{who}(pcp_size={pcp_size!r}) with a group of {group.size}: a runner runs PCP over its "
                         f"DCP group; pass pcp_size={group.size} or 1")
    return int(pcp_size)


class StepRunner:
    """One rank's model runner (module docstring): a NaN-filled paged cache of ``num_blocks`` blocks.

    Arguments
    ---------
    group: this rank's DCP group (size 1: one device). model: a family or its name.
    num_blocks, block_size, interleave_size: the cache layout, the block manager's (block ids
        ``0 .. num_blocks - 1``; block ``num_blocks`` is the spare that pads block tables).
    max_model_len: the longest sequence (prompt + outputs + drafts) a block table must cover.
    merge: the DCP merge (:data:`cpattn.engine.paged_cache.STEP_MERGES`).
    capture: graph backend for uniform decode steps ("eager", "aot_eager", "inductor", "auto"),
        or None (every step eager); capture_sizes / max_num_seqs / num_speculative_tokens size it.
    pcp_size: 1, or P in 2..``group.size``: a step's prefill chunks run PCP (``pcp_method`` "ring" or
        "allgather"; DSA-CP for a DSA model) over the PCP group (``runner.pcp_group``: the group itself when
        P = ``group.size``, else its first P ranks, None on the others, which compute none of the chunks' rows;
        :mod:`cpattn.engine.runner_pcp`), its decodes DCP over the whole group.
        ``pcp_method="auto"`` (default): "ring" for prompts from the start, "allgather" for a step whose
        chunks attend a cached context (each part then attends context and chunk in one causal call,
        :meth:`cpattn.engine.prefill_steps.PCPStep._with_context`: no separate context partials to merge).
        pcp_min_tokens: with ``pcp_size > 1``, a chunk of fewer new tokens runs DCP attention with the decodes
        instead (elastic CP: PCP only where it pays, :func:`cpattn.engine.elastic.pcp_min_tokens`).
    poison: NaN-fill each freshly handed-out block before the step (tests; costs a write per block).
    dcp_size: None (the DCP group is ``group``), or N < ``group.size`` with ``pcp_size = group.size``: ``group``
        is the engine's world, its first N ranks the DCP group (``runner.group``, None on the others, which
        hold no cache and take DCP rank 0's step outputs; ``runner.world``: the world): :mod:`~.runner_wide`.
    algorithms: None (``pcp_method`` as above), or exactly these (``runner.algorithms``, no "auto"): their
        ``pcp_method`` (GQA / MLA chunks under PCP; a DSA chunk runs DSA-CP), ``dsa_split`` (a DSA model's PCP
        split) and ``handoff`` (rows to their DCP owners: a PCP step's whose chunks all end their prompts -- else
        the rows are all-gathered, kept for the next chunk -- and short chunks' under elastic CP);
        ``merge`` is still the DCP merge (:class:`~cpattn.engine.llm.LLMEngine` passes ``algorithms.dcp_merge``;
        a DSA layer merges with one all-gather whatever it is).

    ``runner.prompt_logits = True`` (off by default): each step also hands back every prefill row's logits
    (``StepResult.chunk_logits``; under PCP the prefill then gathers all its rows' logits, and short chunks
    no longer run data-parallel), what ``LLMEngine(return_prompt_logits=True)`` collects.
    """

    other_caches: tuple = ()  # non-paged cache kinds a subclass runs (runner_hybrid: "hybrid")
    prompt_logits = False  # hand back every prefill row's logits (StepResult.chunk_logits)
    chunk_logits: dict | None = None  # this step's, while it runs (run_prefill_rows fills it under PCP)

    def __init__(self, group: Group, model: ModelFamily | str, params: dict, cfg: Any, *, num_blocks: int,
                 block_size: int, max_model_len: int, interleave_size: int = 1, merge: str = ENGINE_MERGE,
                 capture: str | None = None, capture_sizes=None, max_num_seqs: int = 8,
                 num_speculative_tokens: int = 0, pcp_size: int = 1, pcp_method: str = "auto",
                 hidden_layers: tuple | None = None, poison: bool = False, pcp_min_tokens: int = 0,
                 dcp_size: int | None = None, algorithms: Algorithms | None = None) -> None:
        self.family, self.params, self.cfg = get_family(model), params, cfg
        # the engine's world, its DCP group (the first dcp_size ranks; None on the others: runner_wide)
        self.world, self.dcp_size, group = runner_wide.dcp_of(group, dcp_size, pcp_size)
        self.group = group
        self.pcp_size, self._auto_pcp = check_pcp_size(pcp_size, self.world, "StepRunner", sub_group=True), \
            pcp_method == "auto" and algorithms is None
        # the group a step's PCP chunks run over: the world, or its first pcp_size ranks (every rank splits)
        w = self.world
        self.pcp_group = w if self.pcp_size in (1, w.size) else w.split(range(self.pcp_size))
        self.algorithms = algorithms or Algorithms(pcp_method="ring" if self._auto_pcp else pcp_method)
        self.pcp_min_tokens = pcp_min_tokens
        if not self.family.backend.per_token_kv and self.family.cache not in self.other_caches:
            what = {"hybrid": "paged KV plus per-request linear-attention states",
                    "v4": "window rings + compressed entries"}.get(self.family.cache, "not per-token KV")
            runner = {"hybrid": "runner_hybrid.HybridStepRunner", "v4": "runner_v4.V4StepRunner"}.get(self.family.cache)
            fix = f"build LLMEngine (it picks cpattn.engine.{runner}) or use that runner" if runner else \
                "use cpattn.engine.generate for it"
            raise ValueError(f"StepRunner runs paged-cache families; {self.family.name} keeps its own cache "
                             f"(ModelFamily.cache={self.family.cache!r}: {what}): {fix}")
        span = block_size * self.dcp_size
        self.max_blocks = -(-max_model_len // span)
        layouts = self.family.kv_layouts(cfg)
        blocks = 0 if group is None else num_blocks + 1  # a rank outside the DCP group holds no cache at all
        k, v, ki = nan_caches(layouts, (blocks, block_size), param_dtype(params), "cpu")
        self.spare = num_blocks
        self.shard = PagedShard(layouts, k, v, ki, torch.zeros(0, self.max_blocks, dtype=torch.int64), block_size,
                                interleave_size)
        self._tables = BlockTableRows(self.max_blocks, self.spare, rows=max_num_seqs)
        self._tokens, self._seq_lens = HostInts(max_num_seqs), HostInts(max_num_seqs)  # a replay's, in place
        self.pcp_context: dict = {}  # run_prefill_rows: the context of each prefill continuing under PCP
        self.poison = poison
        self.dp_stats = runner_dp.DPStats()  # data-parallel prefill of short chunks (elastic CP)
        self.hidden_layers = hidden_layers
        self._step = functools.partial(decode_step, family=self.family, cfg=cfg, group=group, merge=merge,
                                       hidden_layers=hidden_layers)
        self._state = {"params": params, "shard": self.shard}
        self.graph: DecodeRunner | None = None
        if capture is not None and group is not None:  # outside the DCP group: rank 0's decode outputs
            q = 1 + num_speculative_tokens
            self.graph = DecodeRunner(self._step, self._state, step_fields(self.max_blocks),
                                      num_speculative_tokens=num_speculative_tokens,
                                      capture_sizes=list(capture_sizes) if capture_sizes else None,
                                      max_size=max(q, max_num_seqs * q), backend=capture).capture()

    def kv_bytes(self) -> int:
        """Bytes of this rank's KV storage (the whole block pool, used or not)."""
        return self.shard.kv_bytes()

    def batch(self, out: SchedulerOutput, width: int | None = None) -> dict[str, torch.Tensor]:
        """The step's inputs: tokens [T], seq_lens [B], block_table [B, width] (spare-padded).

        ``width`` None: the captured programs' ``max_blocks``, and every input is a view of the runner's
        persistent host tensors (the table's :class:`~cpattn.engine.step_inputs.BlockTableRows`: only changed
        rows are written; tokens and seq_lens: :class:`~cpattn.engine.step_inputs.HostInts`), valid until the
        next call -- what a replay copies into its program's buffers; an eager step passes its own longest
        table and gets tensors of its own."""
        table = self._tables.update(out.block_tables, out.req_ids)
        if width is None:
            return {"tokens": self._tokens.write(flat(out.input_ids)), "seq_lens": self._seq_lens.write(out.seq_lens),
                    "block_table": table}
        return {"tokens": int64(flat(out.input_ids)), "seq_lens": int64(out.seq_lens),
                "block_table": table[:, :width].clone()}

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one scheduled step on this rank (every rank of the group, the same ``out``)."""
        if self.prompt_logits:
            self.chunk_logits = {}
            res = self._execute(out)
            return dataclasses.replace(res, chunk_logits=self.chunk_logits)
        return self._execute(out)

    def pcp_rows(self, out: SchedulerOutput) -> list[int]:
        """The prefill rows of ``out`` that run PCP (with ``pcp_size > 1``; elastic CP: :func:`~.elastic.runs_pcp`)."""
        if self.pcp_size == 1:
            return []
        m = self.pcp_min_tokens
        return [b for b, p in enumerate(out.is_prefill) if p and runs_pcp(out.query_lens[b], out.context_lens[b], m)]

    def _execute(self, out: SchedulerOutput) -> StepResult:
        dp = [] if self.prompt_logits else runner_dp.dp_rows(self, out)  # elastic CP: short chunks one rank each
        if dp:
            return runner_dp.execute_with_dp(self, out, dp)
        if self.poison and out.fresh_blocks and self.group is not None:
            ids = torch.tensor(out.fresh_blocks, dtype=torch.int64)
            for t in (*self.shard.k, *self.shard.v, *self.shard.k_index):
                if t is not None:
                    t[ids] = float("nan")
        for row in out.loads if self.group is not None else ():  # second-tier spans, into their fresh blocks
            for block_id, payloads in row:
                self.shard.write_block(block_id, payloads[self.group.rank])
        if not out.req_ids:
            return StepResult({}, {}, False, 0)
        sent, t0 = self._sent(), time.perf_counter()
        pre = self.pcp_rows(out)
        if pre:  # long chunks under PCP, then the decodes and short chunks (a mixed step: eager)
            dec = [b for b in range(len(out.req_ids)) if b not in set(pre)]
            chunks = rows_of(out, pre)
            table = self.batch(chunks, max(len(ids) for ids in chunks.block_tables))["block_table"]
            t1 = time.perf_counter()
            algorithms = self.algorithms
            if self._auto_pcp and any(chunks.context_lens):
                algorithms = dataclasses.replace(algorithms, pcp_method="allgather")
            outputs, rows, hidden = run_prefill_rows(self, chunks, table, algorithms)
            times = [t1 - t0, time.perf_counter() - t1, 0.0]
            if dec:
                o, r, _, more, h = self._forward(rows_of(out, dec), graph=False)
                outputs, rows = {**outputs, **o}, {**rows, **r}
                hidden = None if hidden is None else {**hidden, **h}
                times = [a + b for a, b in zip(times, more)]
            return StepResult(outputs, rows, False, self._sent() - sent, *times, len(pre), hidden)
        self.pcp_context.clear()  # a step without PCP chunks breaks every chain of kept contexts
        outputs, rows, replayed, times, hidden = self._forward(out, graph=True)
        return StepResult(outputs, rows, replayed, self._sent() - sent, *times, 0, hidden)

    def _sent(self) -> int:
        """Bytes this rank sent so far, over the world, the DCP group and a PCP sub-group (each counted once)."""
        groups = {id(g): g for g in (self.world, self.group, self.pcp_group) if g is not None}
        return sum(g.stats.total_sent() for g in groups.values())

    def _forward(self, out: SchedulerOutput, *, graph: bool):
        """Every row through the DCP step (replayed when ``graph`` allows and the step is a uniform 1+k
        decode): (outputs, logits rows, replayed, [prepare_s, forward_s, sample_s], hidden or None)."""
        t0, replayed = time.perf_counter(), False
        if graph and self.graph is not None and out.uniform_decode and out.query_lens[0] == self.graph.q_len:
            batch = self.batch(out)
            t1 = time.perf_counter()
            res = self.graph(batch, list(out.query_lens))
            replayed = self.graph.stats.last.startswith("graph")
        elif self.group is None:  # a PCP rank outside the DCP group: no cache, rank 0's step outputs below
            res, t1 = None, time.perf_counter()
        else:  # eager: the table only as wide as this step's longest, so attention reads no unused block
            batch = self.batch(out, max(1, max(len(ids) for ids in out.block_tables)))
            t1 = time.perf_counter()
            cu = torch.tensor(cu_seqlens(out.query_lens), dtype=torch.int32)
            res = self._step(self._state, {**batch, "cu_seqlens_q": cu})
        if self.world is not self.group:  # PCP wider than the DCP group: every rank takes DCP rank 0's outputs
            res = runner_wide.step_from_rank0(self.world, res, self.hidden_layers)
        logits, greedy = res[0], res[1]
        full = res[2] if self.hidden_layers is not None else None  # {name: [T, ...]}
        if self.chunk_logits is not None and any(out.is_prefill):  # prompt_logits: each chunk's every row
            cu = cu_seqlens(out.query_lens)
            self.chunk_logits.update({out.req_ids[b]: logits[cu[b]:cu[b + 1]] for b, p in enumerate(out.is_prefill)
                                      if p})
        t2 = time.perf_counter()
        outputs, spans, hidden = {}, {}, ({} if full is not None else None)
        chosen = greedy.tolist()  # one device->host copy; acceptance is plain list work
        if any(out.sampling):  # None: a greedy row
            chosen = choose(logits, chosen, sampled_positions(out))
        end, samples, draft_tokens = 0, out.samples, out.draft_tokens
        if full is None and len(chosen) == len(out.req_ids) and all(samples) and not any(draft_tokens):
            # one token per row, no drafts: the scheduler commits it without per-row objects
            outputs = OneTokenRows(out.req_ids, chosen)
            return outputs, LogitRows(logits, outputs.spans), replayed, [t1 - t0, t2 - t1, time.perf_counter() - t2], None
        for b, (rid, q) in enumerate(zip(out.req_ids, out.query_lens)):
            begin, end = end, end + q
            if not samples[b]:
                outputs[rid] = _NOTHING
                if full is not None:
                    hidden[rid] = {n: h[begin:end] for n, h in full.items()}
                continue
            drafts = draft_tokens[b]
            if drafts:
                d = len(drafts)
                g = chosen[end - 1 - d:end]  # [1 + d]: the target's choice after the last token and each draft
                a = 0
                while a < d and drafts[a] == g[a]:  # accept_drafts, on host ints
                    a += 1
                outputs[rid] = ModelOutput(tuple(g[: a + 1]))
            else:
                d = a = 0
                outputs[rid] = ModelOutput((chosen[end - 1],))
            spans[rid] = (end - 1 - d, end - d + a)
            if full is not None:  # rejected drafts' rows are not final
                hidden[rid] = {n: h[begin:end - d + a] for n, h in full.items()}
        rows = LogitRows(logits, spans)
        return outputs, rows, replayed, [t1 - t0, t2 - t1, time.perf_counter() - t2], hidden
