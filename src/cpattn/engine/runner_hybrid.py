"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5) in the step loop: the paged runner plus state slots.

A hybrid family (``ModelFamily.cache == "hybrid"``, :mod:`cpattn.engine.backends.hybrid`) has two kinds of
token mixer. :class:`HybridStepRunner` is a :class:`~cpattn.engine.runner.StepRunner` (same
``execute(SchedulerOutput) -> StepResult``, same paged cache, block tables, block manager accounting and
eager / captured step) whose step function also carries the linear layers' states:

- **full-attention layers**: exactly the paged runner's DCP step (a prefill chunk attends to its cached
  context and itself; a decode is one query row), the KV sharded over the DCP ranks;
- **linear-attention layers**: one *slot* per running request (``max_num_seqs`` slots) holding, per linear
  layer, its conv state [K-1, C] and recurrent state [Hv, Dk, Dv] -- on every DCP rank (replicated: a fixed
  size, updated identically). A row of the step reads its request's slot (zeros for a row at context 0), runs
  the causal conv over its new tokens from that conv state and the chunked gated delta rule from that state
  (the recurrent op when every row brings one token), and writes the states after its tokens back. So a
  prompt cut into chunks of any size (a boundary inside the conv kernel's width too) continues exactly.
- A request preempted, finished or aborted loses its slot when the step that reports it executes; the
  slot is NaN-poisoned (a later reader shows). Preemption is recompute: a readmitted request starts again
  from context 0 in a fresh slot.

What the step loop cannot do for a hybrid model is refused when the engine is built
(:func:`hybrid_scheduler_config`): prefix caching and a KV pool (cached whole blocks carry KV rows, not a
snapshot of the linear states at block boundaries: snapshots would cost one state copy per block per request,
not done). Drafters work, token drafters (n-gram, a draft model) and those that read the target's hidden
states (``hidden_layers``: Qwen3-Next's MTP module, :mod:`cpattn.drafters.qwen3_next_mtp`; the step returns
each row's final hidden rows, a chunk's every row and a decode's last token and accepted drafts, under PCP
too): a decode row of ``1 + d`` tokens (the last token and d drafts) runs the linear layers token by token,
leaving the state after each position in per-position buffers (``pending``, [slots, 1 + k, ...]) instead
of the slot; once acceptance is known (a drafts) the runner commits the state after position a, the last accepted token's, to the slot, so the rejected drafts
leave no trace (their KV is rolled back by the scheduler). PCP (``pcp_size`` P > 1):
a step's prefill chunks (of at least ``pcp_min_tokens`` new tokens) run split head-tail over the DCP group, or
its first P ranks (:mod:`cpattn.engine.runner_hybrid_pcp`; the other ranks compute none of the chunks' rows,
get their KV rows and rank 0's states and logits): the attention layers by ring / all-gather attention with the
cached context gathered from the DCP shards as a replicated prefix (as :mod:`cpattn.engine.runner_pcp`), the
linear layers by the exact scan (:class:`~cpattn.linear.pcp_step.PCPLinearStep`) starting from each request's
slot; every rank ends with the same states, written back to the slots, and the new KV rows go to their DCP
owners by the paged hand-off. The step's decodes (and shorter chunks) then run the DCP step. With
``pcp_size > dcp_size`` (``dcp_size=``, :mod:`cpattn.engine.runner_wide`) the chunks run PCP over the whole
world and its ranks past the DCP group hold no KV and no states (DCP rank 0's decode outputs).
P/D (``connector``: the engine's bound :class:`~cpattn.engine.connector_hybrid.HybridPDConnector`): a producer's
row that ends a prompt stages the request's slot states and its logits with the connector; a consumer's prompt
rows of a handed request compute nothing (:meth:`HybridStepRunner._handed`: the handed KV rows written into the
row's blocks, the producer's states installed and the first token sampled from the handed logits at the row
that ends the prompt; a hidden-state drafter's rows of the row's positions, handed over too, handed back as the
step's). Captured decode: the family is not capturable by a compiler; the ``"eager"`` graph
backend (persistent buffers, padding rows write nothing) replays uniform decode steps, of 1 + k tokens a row
with drafts.

Example
-------
>>> import cpattn
>>> from cpattn.engine.blocks import BlockManager
>>> from cpattn.engine.scheduler import Scheduler
>>> from cpattn.models import qwen3_next as qn
>>> cfg = qn.Qwen3NextConfig.tiny()
>>> params = qn.init_params(cfg)
>>> def rank(g):
...     s = Scheduler(BlockManager(8, 4, dcp_size=g.size, enable_caching=False), max_num_batched_tokens=5,
...                   max_num_seqs=2)
...     run = HybridStepRunner(g, "qwen3_next", params, cfg, num_blocks=8, block_size=4, max_model_len=32)
...     rid = s.add_request(list(range(1, 12)), max_tokens=3)   # 11 tokens: chunks of 5, 5, 1
...     while s.has_unfinished():
...         s.update(run.execute(s.schedule()).outputs)
...     held = run.live                      # the scheduler reports the finish with its next step
...     run.execute(s.schedule())
...     return s.output_tokens(rid), held, run.live
>>> (a, held, live), (b, *_) = cpattn.simulate(2, rank)
>>> a == b, len(a), held, live
(True, 3, 1, 0)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Hashable
from dataclasses import replace
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.config import SchedulerConfig
from cpattn.engine.backends.hybrid_states import SlotStates, commit_positions, pending_states
from cpattn.engine.decode import batch_step, step_fields
from cpattn.engine.hidden_rows import handed_hidden
from cpattn.engine.logits import forward_logits
from cpattn.engine.runner import StepResult, StepRunner, check_pcp_size
from cpattn.engine.runner_hybrid_pcp import pcp_chunks, pcp_group
from cpattn.engine.runner_pcp import rows_of
from cpattn.engine.sampling import choose, sampled_positions
from cpattn.engine.scheduler import ModelOutput, SchedulerOutput
from cpattn.graphs.runner import DecodeRunner, Field
from cpattn.models.family import ModelFamily, get_family, param_dtype
from cpattn.dcp.layer_merges import ENGINE_MERGE


def hybrid_scheduler_config(family: ModelFamily, scheduler: SchedulerConfig | None, *, kv_pool=None,
                            drafter=None) -> SchedulerConfig:
    """The scheduler config of a hybrid engine, or a one-line ValueError naming what it cannot do.

    ``scheduler=None`` gives the defaults with prefix caching off (chunked prefill stays on). Every drafter is
    served (``drafter`` is kept for the callers; it refuses nothing).

    >>> from cpattn.models.family import get_family
    >>> c = hybrid_scheduler_config(get_family("qwen3_next"), None)
    >>> c.enable_prefix_caching, c.enable_chunked_prefill
    (False, True)
    """
    from cpattn.engine.connector_pd import PDConnector

    name = family.name
    why = "cached whole blocks carry KV rows but no snapshot of the linear layers' states at block boundaries"
    if kv_pool is not None and not isinstance(kv_pool, PDConnector):  # PDConnector: P/D, blocks + states
        raise ValueError(f"kv_pool: {name} is a hybrid model ({why}), so a pool cannot serve its prefixes; "
                         "pass kv_pool=None (P/D: kv_connector=PDConnector(), which hands the states over)")
    if scheduler is None:
        return SchedulerConfig(enable_prefix_caching=False)
    if scheduler.enable_prefix_caching:
        raise ValueError(f"enable_prefix_caching=True: {name} is a hybrid model ({why}); pass "
                         "SchedulerConfig(enable_prefix_caching=False)")
    return scheduler


def hybrid_loop_step(state: dict, batch: dict[str, torch.Tensor], *, family: ModelFamily, cfg: Any, group: Group,
                     merge: str, decode: bool | None = None, width: int | None = None,
                     hidden_layers: tuple | None = None):
    """One step of the hybrid runner: :func:`cpattn.engine.decode.decode_step`'s DCP attention over
    ``state["shard"]`` plus :class:`SlotStates` over ``state["states"]`` rows ``batch["slots"]``.
    decode: every row one token (None: read from ``cu_seqlens_q``, a host sync: eager steps only).
    With drafts (``state["pending"]`` and ``batch["verify"]`` [B] bool, the rows carrying drafts): those rows
    leave the state after each position in ``state["pending"]`` (:class:`SlotStates`); ``width``: a captured
    program whose every row is ``width`` = 1 + k tokens (None: the verify rows read from the batch, a host sync).
    Returns (logits [T, V], argmax [T]), plus the hidden states ``{name: [T, H]}`` a drafter reads as a third
    output with ``hidden_layers``."""
    cu = batch["cu_seqlens_q"]
    ql = cu[1:] - cu[:-1]  # [B]
    tokens = batch["tokens"]
    attn = batch_step(group, state["shard"], batch, merge)
    if decode is None:
        decode = bool((ql == 1).all())
    verify, only = None, False
    if "verify" in batch:
        if width is not None:  # a captured 1 + k program: every row verifies, padding rows own no tokens
            verify, only = (torch.arange(ql.shape[0], device=ql.device), width), True
        else:
            rows = batch["verify"].nonzero().flatten()
            verify = (rows, int(ql[rows].max())) if rows.numel() else None
    lin = SlotStates(state["states"], batch["slots"], batch["seq_lens"] - ql == 0, cu, decode, verify=verify,
                     pending=state.get("pending"), only=only)
    return forward_logits(family.forward, state["params"], cfg, tokens, attn, lin, hidden_layers=hidden_layers)


class HybridStepRunner(StepRunner):
    """One rank's hybrid model runner (module docstring); the arguments of :class:`~cpattn.engine.runner.StepRunner`
    (``pcp_size > 1``: prefill chunks run PCP, see the module doc; ``num_speculative_tokens`` = k: decode rows of
    1 + k tokens verified with per-position states, see the module doc; ``hidden_layers``: the hidden states
    a drafter reads, in ``StepResult.hidden`` as StepRunner gives them; ``connector``: the engine's bound KV
    connector, whose ``stage`` / ``take`` a P/D pair's hybrid connector has, see the module doc; ``algorithms``:
    as StepRunner's, ``pcp_method`` for the attention layers' PCP and ``handoff`` for the PCP rows, ``dsa_split``
    unused: no DSA layer).

    ``live``: requests holding a slot; ``states``: the slots' linear-layer states.
    """

    other_caches = ("hybrid",)

    def __init__(self, group: Group, model: ModelFamily | str, params: dict, cfg: Any, *, num_blocks: int,
                 block_size: int, max_model_len: int, interleave_size: int = 1, merge: str = ENGINE_MERGE,
                 capture: str | None = None, capture_sizes=None, max_num_seqs: int = 8,
                 num_speculative_tokens: int = 0, pcp_size: int = 1, pcp_method: str = "ring",
                 hidden_layers: tuple | None = None, poison: bool = False, pcp_min_tokens: int = 0,
                 connector=None, dcp_size: int | None = None, algorithms=None) -> None:
        family = get_family(model)
        if family.cache != "hybrid":
            raise ValueError(f"HybridStepRunner runs families declaring cache='hybrid'; {family.name} declares "
                             f"cache={family.cache!r}: use cpattn.engine.runner.StepRunner")
        if capture not in (None, "eager"):
            raise ValueError(f"graph backend {capture!r}: the {family.name} decode step is not capturable by a "
                             "compiler; use graph_backend='eager' (or 'auto') or graph_mode='NONE'")
        super().__init__(group, family, params, cfg, num_blocks=num_blocks, block_size=block_size,
                         max_model_len=max_model_len, interleave_size=interleave_size, merge=merge, capture=None,
                         max_num_seqs=max_num_seqs, pcp_size=pcp_size if self._wide(group, dcp_size) else 1,
                         pcp_method=pcp_method, poison=poison, pcp_min_tokens=pcp_min_tokens, dcp_size=dcp_size,
                         algorithms=algorithms)
        self.connector = connector  # the engine's bound KV connector (P/D: connector_hybrid), or None
        self.pcp_size = check_pcp_size(pcp_size, self.world, "HybridStepRunner", sub_group=True)  # not StepRunner's:
        self.pcp_group = pcp_group(self.world, self.pcp_size)  # the chunks' PCP: runner_hybrid_pcp.pcp_chunks
        dev = params["model.embed_tokens.weight"].device  # outside the DCP group (runner_wide): no slot states
        self.states = family.recurrent_cache(cfg, batch=0 if self.group is None else max_num_seqs,
                                             dtype=param_dtype(params), device=dev)
        for t in (*self.states.conv, *self.states.state):
            t.fill_(float("nan"))  # a free slot: never read
        self.slots: dict[Hashable, int] = {}
        self.seen: dict[Hashable, int] = {}  # tokens each slot's states have absorbed
        self._free = list(range(max_num_seqs))
        self.k = k = num_speculative_tokens
        self.hidden_layers = hidden_layers  # a drafter's (MTP): StepRunner._forward hands each row's rows back
        self._step = functools.partial(hybrid_loop_step, family=self.family, cfg=cfg, group=self.group, merge=merge,
                                       hidden_layers=hidden_layers)
        self._state = {"params": params, "shard": self.shard, "states": self.states}
        if k:  # the state after each of a verify row's 1 + k positions, committed at the accepted one
            self._state["pending"] = pending_states(self.states, 1 + k)
        if capture is not None and self.group is not None:
            fields = {**step_fields(self.max_blocks), "slots": Field("request", (), torch.int64, pad=-1)}
            if k:
                fields["verify"] = Field("request", (), torch.bool, pad=False)
            step = functools.partial(self._step, decode=False, width=1 + k) if k else \
                functools.partial(self._step, decode=True)
            self.graph = DecodeRunner(step, self._state, fields, num_speculative_tokens=k,
                                      capture_sizes=list(capture_sizes) if capture_sizes else None,
                                      max_size=max_num_seqs * (1 + k), backend=capture).capture()

    @staticmethod
    def _wide(group: Group, dcp_size: int | None) -> bool:
        """PCP over a world wider than the DCP group (:mod:`~.runner_wide`: StepRunner splits off the first N)."""
        return dcp_size is not None and dcp_size != group.size

    @property
    def live(self) -> int:
        return len(self.slots)

    def kv_bytes(self) -> int:
        """Bytes of this rank's storage: the attention layers' block pool and every slot's recurrent states."""
        return self.shard.kv_bytes() + self.states.state_bytes()

    def release(self, req_ids) -> None:
        """Drop the states of ``req_ids`` (finished, aborted or preempted: a readmission recomputes them)."""
        for rid in req_ids:
            slot = self.slots.pop(rid, None)
            self.seen.pop(rid, None)
            if slot is None:
                continue
            self._free.append(slot)
            for t in (*self.states.conv, *self.states.state) if self.group is not None else ():
                t[slot] = float("nan")

    def batch(self, out: SchedulerOutput, width: int | None = None) -> dict[str, torch.Tensor]:
        """:meth:`StepRunner.batch` plus ``slots`` [B]: each row's state slot (and, with drafts, ``verify`` [B]:
        the rows carrying drafts)."""
        got = {**super().batch(out, width), "slots": torch.tensor([self.slots[r] for r in out.req_ids],
                                                                  dtype=torch.int64)}
        if self.k:
            got["verify"] = torch.tensor([bool(d) for d in out.draft_tokens], dtype=torch.bool)
        return got

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one scheduled step on this rank (every rank of the group, the same ``out``)."""
        self.release([*out.preempted, *out.finished])
        for b, rid in enumerate(out.req_ids):
            ctx = out.context_lens[b]
            if ctx == 0:  # a new request, or a preempted one recomputing prompt and outputs
                self.release([rid])
                if not self._free:
                    raise RuntimeError(f"request {rid!r}: no free state slot of {len(self.slots)}; the scheduler "
                                       "ran more requests than max_num_seqs")
                self.slots[rid], self.seen[rid] = self._free.pop(0), 0
            elif self.seen.get(rid) != ctx:
                raise RuntimeError(f"request {rid!r}: its linear states hold {self.seen.get(rid)} tokens but the "
                                   f"step continues after {ctx}")
            if out.draft_tokens[b] and not self.k:
                raise RuntimeError(f"request {rid!r}: {len(out.draft_tokens[b])} drafts; this hybrid runner was "
                                   "built with num_speculative_tokens=0")
        take = getattr(self.connector, "take", None)  # P/D consumer: prompt rows handed over, not computed
        handed = {b: got for b, rid in enumerate(out.req_ids) if take is not None and out.is_prefill[b]
                  and (got := take(rid, out.context_lens[b], out.query_lens[b])) is not None}
        res = self._handed(out, handed) if handed else self._run(out)
        rows = [b for b, d in enumerate(out.draft_tokens) if d]
        if rows:  # each verify row keeps the state after its last accepted token (the bonus token's input)
            acc = [len(res.outputs[out.req_ids[b]].sampled) - 1 for b in rows]
            if self.group is not None:  # outside the DCP group: no states
                commit_positions(self.states, self._state["pending"],
                                 torch.tensor([self.slots[out.req_ids[b]] for b in rows]), torch.tensor(acc))
            for b, a in zip(rows, acc):
                self.seen[out.req_ids[b]] -= len(out.draft_tokens[b]) - a  # rejected drafts: not absorbed
        for b, rid in enumerate(out.req_ids):
            self.seen[rid] += out.query_lens[b]
        stage = getattr(self.connector, "stage", None)  # P/D producer: the consumer gets these states
        if stage is not None:
            for b, rid in enumerate(out.req_ids):
                if out.is_prefill[b] and out.samples[b] and b not in handed:
                    slot = self.slots[rid]
                    stage(rid, [t[slot] for t in self.states.conv], [t[slot] for t in self.states.state],
                          res.logits[rid][-1], self.seen[rid], self.group.rank)
        return res

    def _run(self, out: SchedulerOutput) -> StepResult:
        """The step's rows through the model: long prefill chunks under PCP (with ``pcp_size > 1``), the rest
        through the DCP step."""
        pre = self.pcp_rows(out)
        if pre:  # the long chunks under PCP, then the decodes and short chunks through the DCP step
            super().execute(rows_of(out, []))  # the fresh blocks' poisoning (and chunk_logits = {} if kept)
            sent, t0 = self._sent(), time.perf_counter()
            outputs, rows, hidden = pcp_chunks(self, rows_of(out, pre))
            times = [0.0, time.perf_counter() - t0, 0.0]
            dec = [b for b in range(len(out.req_ids)) if b not in set(pre)]
            if dec:
                o, r, _, more, h = self._forward(rows_of(out, dec), graph=False)
                outputs, rows = {**outputs, **o}, {**rows, **r}
                hidden = None if hidden is None else {**hidden, **h}
                times = [a + b for a, b in zip(times, more)]
            res = StepResult(outputs, rows, False, self._sent() - sent, *times, len(pre), hidden,
                             chunk_logits=self.chunk_logits)
        else:
            res = super().execute(out)
        return res

    def _handed(self, out: SchedulerOutput, handed: dict) -> StepResult:
        """A step with prefill rows a P/D producer handed over (``handed[b]``: the connector's
        :class:`~cpattn.engine.connector_hybrid.HybridEntry`): each writes the handed KV rows of its positions
        ``context .. context + q - 1`` that this rank owns into its blocks, computing nothing; the row that ends
        the prompt installs the handed states in the request's slot and samples the first token from the handed
        logits [V]; with ``hidden_layers``, each row hands back the producer's hidden rows of its positions
        (handed over too). The step's other rows then run as usual (:meth:`_run`)."""
        t0 = time.perf_counter()
        super().execute(rows_of(out, []))  # the fresh blocks' poisoning, before the handed rows land in them
        size, n, rank = self.shard.block_size, self.group.size, self.group.rank
        rows, where, sampled = [], [], []
        for b, e in handed.items():
            ctx, q, table = out.context_lens[b], out.query_lens[b], out.block_tables[b]
            for j in range(ctx // size, (ctx + q - 1) // size + 1):
                if j % n != rank:
                    continue
                lo, hi = max(ctx, j * size) - j * size, min(ctx + q, (j + 1) * size) - j * size
                rows.append(e.blocks[j][lo:hi])
                where.append(torch.arange(lo, hi, dtype=torch.int64) + table[j // n] * size)
            if out.samples[b]:
                if ctx + q != e.num_tokens:
                    raise RuntimeError(f"request {out.req_ids[b]!r}: samples after {ctx + q} tokens, but the "
                                       f"handed prompt has {e.num_tokens}")
                slot = self.slots[out.req_ids[b]]
                for dst, src in zip((*self.states.conv, *self.states.state), (*e.conv, *e.state)):
                    dst[slot] = src.to(dst.dtype)
                sampled.append(b)
        if rows:
            self.shard.write_rows(torch.cat(rows), torch.cat(where))
        outputs, logits = {out.req_ids[b]: ModelOutput() for b in handed}, {}
        hidden = None if self.hidden_layers is None else \
            {out.req_ids[b]: handed_hidden(self.connector, out.req_ids[b], out.context_lens[b],
                                           out.context_lens[b] + out.query_lens[b]) for b in handed}
        if sampled:
            first = torch.stack([handed[b].logits for b in sampled])  # [S, V]
            chosen = first.argmax(-1).tolist()
            sub = rows_of(out, sampled)
            if any(sub.sampling):
                chosen = choose(first, chosen, sampled_positions(sub, last_only=True))
            for i, b in enumerate(sampled):
                outputs[out.req_ids[b]] = ModelOutput((chosen[i],))
                logits[out.req_ids[b]] = first[i:i + 1]
        chunks = self.chunk_logits
        times = [time.perf_counter() - t0, 0.0, 0.0]
        rest = [b for b in range(len(out.req_ids)) if b not in handed]
        if not rest:
            return StepResult(outputs, logits, False, 0, *times, 0, hidden, chunk_logits=chunks)
        res = self._run(replace(rows_of(out, rest), fresh_blocks=()))  # poisoned above
        return StepResult({**outputs, **res.outputs}, {**logits, **res.logits}, False, res.bytes_sent,
                          *[a + b for a, b in zip(times, (res.prepare_s, res.forward_s, res.sample_s))],
                          res.pcp_rows, None if hidden is None else {**hidden, **(res.hidden or {})},
                          chunk_logits=res.chunk_logits)
