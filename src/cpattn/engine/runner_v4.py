"""DeepSeek-V4 in the step loop: a model runner keeping V4's own state (rings + compressed entries) per request.

V4's cache is not per-token KV rows (``family.backend.per_token_kv`` is
False), so :class:`~cpattn.engine.runner.StepRunner`'s paged cache does not
apply. :class:`V4StepRunner` has the same ``execute(SchedulerOutput) ->
StepResult`` interface and keeps, on this rank, one
:class:`~cpattn.v4.engine.V4DecodeCache` whose rows are *slots*, one per
running request (``max_num_seqs`` of them, each sized for the longest
request the block pool admits):

- a prefill row (a new request, or a preempted one recomputing prompt and
  outputs) runs the backend's prefill over the prefill group (PCP over the DCP
  group or its first ``pcp_size`` ranks when ``pcp_size > 1``, else on this
  rank alone, replicated), the backend's ``collect`` / ``place`` seed the
  request's slot with its tail rows and this DCP rank's entries (as the
  fixed-batch path's hand-off does; a rank outside a PCP sub-group receives its
  share: :mod:`cpattn.engine.runner_v4_pcp`; with ``pcp_size > dcp_size`` the
  prefill runs over the whole world and its ranks past the DCP group hold no
  state, taking DCP rank 0's decode outputs: :mod:`cpattn.engine.runner_wide`), and the first token is
  sampled from the prefill's logits (greedy, or the request's sampling
  parameters through :mod:`cpattn.engine.sampling`, as the paged runner);
- the step's decode rows run together through the backend's decode program
  (:class:`~cpattn.v4.engine.V4DecodeProgram` over the slots: one batched
  call per query length; a step of only 1 + k decodes replays a captured
  program when the runner has one), and its ``commit`` keeps the accepted
  drafts (the rejected rows rewound and NaN-poisoned);
- with ``hidden_layers`` (a drafter reading the target's hidden states: DSpark
  reads layers' hyper-connection streams ``[n, n_hc, H]``, MTP / Eagle3 the
  normed rows ``[n, H]``), each step hands back ``StepResult.hidden[req_id] =
  {name: [n, ...]}`` of the row's final positions as
  :class:`~cpattn.engine.runner.StepRunner` does: a prefill's every prompt row
  (gathered by the prefill under PCP), a decode's last token and its accepted
  drafts (the rejected drafts' rows cut). They are outputs of the decode
  program, so a replayed step returns them too;
- a request the scheduler preempts, finishes or aborts loses its slot,
  whose rows are NaN-poisoned again (a later request never reads them),
  when the step that reports it (``preempted`` / ``finished``) executes.

The scheduler's block manager still does the accounting (blocks per request
as for a paged family), so admission and preemption follow the same
policies; the block tables themselves are unused. What V4 cannot do in the
step loop is refused when the engine is built (:func:`v4_scheduler_config`):
prefix caching and a KV pool (no per-token blocks to share; P/D goes through
the direct connector, :mod:`cpattn.engine.connector_v4`: the producer's runner
stages each prefilled request's state, the consumer's places it in the
request's slot at admission and samples the first token from the handed
logits, computing no prompt token), chunked
prefill (a V4 prompt is prefilled in one step: its compressor state does
not continue across chunks). Drafters that read the target's hidden states
run (above), on a P/D consumer too: the handed-over state comes with the
producer's hidden rows of the prompt (:meth:`V4StepRunner._place` hands them back).

Example
-------
>>> import cpattn
>>> from cpattn.engine.blocks import BlockManager
>>> from cpattn.models import deepseek_v4 as v4
>>> cfg = v4.DeepseekV4Config.tiny()
>>> params = v4.init_params(cfg)
>>> def rank(g):
...     s = V4Scheduler(BlockManager(8, 4, dcp_size=g.size), max_num_batched_tokens=32, max_num_seqs=2,
...                     enable_chunked_prefill=False)
...     run = V4StepRunner(g, "deepseek_v4", params, cfg, num_blocks=8, block_size=4, max_model_len=32)
...     rid = s.add_request(list(range(1, 20)), max_tokens=3)
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

import time
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.config import SchedulerConfig
from cpattn.engine.hidden_rows import handed_hidden
from cpattn.engine.options import Algorithms
from cpattn.engine.runner import StepResult, check_pcp_size
from cpattn.engine.runner_v4_pcp import prefill_group, prefill_slots
from cpattn.engine.runner_wide import dcp_of, step_from_rank0
from cpattn.engine.scheduler import ModelOutput, Scheduler, SchedulerOutput
from cpattn.graphs.runner import DecodeRunner
from cpattn.layout.rows import cu_seqlens
from cpattn.models.family import ModelFamily, get_family, param_dtype
from cpattn.v4.cache import V4Cache
from cpattn.v4.engine import V4DecodeCache
from cpattn.dcp.layer_merges import ENGINE_MERGE


def v4_scheduler_config(family: ModelFamily, scheduler: SchedulerConfig | None, *, kv_pool=None,
                        drafter=None) -> SchedulerConfig:
    """The scheduler config of a V4 engine, or a one-line ValueError naming what V4 cannot do in the step loop.

    ``scheduler=None`` gives the defaults with chunked prefill and prefix caching off.

    >>> from cpattn.models.family import get_family
    >>> v4_scheduler_config(get_family("deepseek_v4"), None).enable_prefix_caching
    False
    """
    name = family.name
    from cpattn.engine.connector import KVConnector
    from cpattn.engine.connector_v4 import is_v4_direct

    if isinstance(kv_pool, KVConnector) and not is_v4_direct(kv_pool):
        raise ValueError(f"kv_connector={type(kv_pool).__name__}: {name} keeps its own cache (window rings + "
                         "compressed entries), not per-token KV blocks a pool could hold; pass kv_connector=None, "
                         "or PDConnector() for P/D (its whole state goes to the consumer)")
    if kv_pool is not None and not is_v4_direct(kv_pool):
        raise ValueError(f"kv_pool: {name} keeps its own cache (window rings + compressed entries), not per-token "
                         "KV blocks a pool could hold; pass kv_pool=None (P/D: kv_connector=PDConnector())")
    if scheduler is None:
        return SchedulerConfig(enable_chunked_prefill=False, enable_prefix_caching=False)
    if scheduler.enable_prefix_caching:
        raise ValueError(f"enable_prefix_caching=True: {name}'s cache (window rings + compressed entries) has no "
                         "per-token blocks to share; pass SchedulerConfig(enable_prefix_caching=False)")
    if scheduler.enable_chunked_prefill:
        raise ValueError(f"enable_chunked_prefill=True: a {name} prompt is prefilled in one step (its compressor "
                         "state does not continue across chunks); pass SchedulerConfig(enable_chunked_prefill=False) "
                         "and max_num_batched_tokens >= the longest prompt + max_tokens - 1")
    return scheduler  # ``drafter``: any (one reading hidden states gets StepResult.hidden, V4StepRunner)


class V4Scheduler(Scheduler):
    """The :class:`~cpattn.engine.scheduler.Scheduler` of a V4 engine: a request whose prompt (or its recompute
    after a preemption, prompt + outputs) could not fit one step is refused at :meth:`add_request`, with the fix
    that applies to V4 (no chunked prefill for it)."""

    def add_request(self, prompt: Sequence[int], *, max_tokens: int = 16, stop_token_ids: Sequence[int] = (),
                    req_id: Hashable | None = None, **kwargs) -> Hashable:
        longest = len(prompt) + max_tokens - 1 if isinstance(max_tokens, int) else 0
        if longest > self.max_num_batched_tokens:
            raise ValueError(f"request of {len(prompt)} prompt + {max_tokens} max_tokens - 1 = {longest} tokens: "
                             "DeepSeek-V4 prefills a prompt (or its recompute after a preemption) in one step, but "
                             f"max_num_batched_tokens is {self.max_num_batched_tokens}: raise it to >= {longest} or "
                             "shorten the request")
        return super().add_request(prompt, max_tokens=max_tokens, stop_token_ids=stop_token_ids, req_id=req_id,
                                   **kwargs)


def _poison_slot(cache: V4Cache, slot: int) -> None:
    """NaN-fill every block of one cache row (rings, entries, indexer keys), as a fresh cache is."""
    lay, t = cache.layout, cache.tables
    for layer, kind in enumerate(lay.kinds):
        pairs = [(cache.window[layer], "window")]
        if kind != "sliding":
            pairs += [(cache.raw[layer], f"raw_{kind}"), (cache.entries[layer], f"ent_{kind}")]
        if kind == "csa":
            pairs += [(cache.index_raw[layer], "raw_csa"), (cache.index_keys[layer], "ent_csa")]
        for tensor, table in pairs:
            tensor[t[table][slot]] = float("nan")


def _sample(out: SchedulerOutput, rows: list[int], logits: torch.Tensor, chosen: list[int], *,
            last_only: bool = False) -> list[int]:
    """The greedy ``chosen`` tokens of ``rows``' positions, with those of sampling requests (temperature > 0,
    ``SchedulerOutput.sampling``) replaced by :mod:`cpattn.engine.sampling`'s pick (the same on every rank)."""
    sampling = getattr(out, "sampling", ())
    if not sampling or all(p is None or p.greedy for p in sampling):
        return chosen
    from cpattn.engine.runner_pcp import rows_of
    from cpattn.engine.sampling import choose, sampled_positions

    return choose(logits, chosen, sampled_positions(rows_of(out, rows), last_only=last_only))


class V4StepRunner:
    """One rank's V4 model runner (module docstring); the arguments of :class:`~cpattn.engine.runner.StepRunner`.

    ``algorithms`` (``runner.algorithms``) change nothing here: V4's prefill has one PCP method and no DSA split,
    its decode merges with one all-gather (``merge`` unused too), its state is handed on by the collect.
    ``live``: requests holding a slot; ``graph``: the captured decode runner (``capture`` given) or None.
    ``runner.prompt_logits = True`` (off by default): each step also hands back every prompt row's logits
    of the prompts it prefilled (``StepResult.chunk_logits``; none for a state a P/D producer handed over).
    ``hidden_layers``: the layers a drafter reads (``drafter.hidden_layers``; the model forward's names: layer
    ids give the hyper-connection streams ``[T, n_hc, H]``, ``"norm"`` the final-normed rows ``[T, H]``); each
    step's ``StepResult.hidden[req_id]`` is then ``{name: [n, ...]}`` of the row's final positions (module
    docstring), else None.
    """

    prompt_logits = False
    chunk_logits: dict | None = None
    _hidden: dict | None = None  # the executing step's hidden rows (StepResult.hidden)

    def __init__(self, group: Group, model: ModelFamily | str, params: dict, cfg: Any, *, num_blocks: int,
                 block_size: int, max_model_len: int, interleave_size: int = 1, merge: str = ENGINE_MERGE,
                 capture: str | None = None, capture_sizes=None, max_num_seqs: int = 8,
                 num_speculative_tokens: int = 0, pcp_size: int = 1, pcp_method: str = "ring",
                 hidden_layers: tuple | None = None, poison: bool = False, connector=None,
                 dcp_size: int | None = None, algorithms: Algorithms | None = None) -> None:
        self.connector = connector  # the engine's bound KV connector (V4 P/D: connector_v4), or None
        # the engine's world, its DCP group (the first dcp_size ranks; None on the others, no state: runner_wide)
        self.world, self.dcp_size, group = dcp_of(group, dcp_size, pcp_size)
        self.group, self.family, self.params, self.cfg = group, get_family(model), params, cfg
        self.backend = self.family.backend
        if self.backend.name != "v4":
            raise ValueError(f"V4StepRunner runs families declaring cache='v4'; {self.family.name} declares "
                             f"cache={self.family.cache!r}: use cpattn.engine.runner.StepRunner")
        self.hidden_layers = None if hidden_layers is None else tuple(hidden_layers)
        self.pcp_size = check_pcp_size(pcp_size, self.world, "V4StepRunner", sub_group=True)
        self.algorithms = algorithms or Algorithms(pcp_method=pcp_method)  # a V4 run is the same whatever they are
        self.prefill_group = prefill_group(self.world, self.pcp_size)  # None outside a PCP sub-group (runner_v4_pcp)
        role = getattr(getattr(connector, "side", None), "role", None)
        if 1 < self.pcp_size < self.dcp_size and role == "kv_producer":
            raise ValueError(f"pcp_size={self.pcp_size} with dcp_size={group.size}: a V4 P/D producer stages the "
                             "prefill's state on every rank; pass pcp_size=1 or the producer's dcp_size")
        self.k = int(num_speculative_tokens)
        longest = min(max_model_len, num_blocks * block_size * self.dcp_size)  # the block pool bounds a request
        self.slots: dict[Hashable, int] = {}
        self._free = list(range(max_num_seqs))
        self.holder = self.program = self.graph = None  # outside the DCP group: no state, no decode program
        if group is None:
            return
        lay = cfg.layout(max_rewind=self.k, block_size=block_size)
        cache = V4Cache.empty(lay, batch=max_num_seqs, max_len=longest + self.k + 1, dtype=param_dtype(params),
                              dcp_rank=group.rank, dcp_size=group.size, interleave_size=interleave_size)
        self.holder = V4DecodeCache(cache)
        self.program = self.backend.program(group, self.family, params, cfg, self.holder, merge=merge,
                                            hidden_layers=self.hidden_layers)  # step -> (logits, argmax[, hidden])
        if capture is not None:
            q = 1 + self.k
            p = self.program
            self.graph = DecodeRunner(p.step, p.state, p.fields, num_speculative_tokens=self.k,
                                      capture_sizes=list(capture_sizes) if capture_sizes else None,
                                      max_size=max(q, max_num_seqs * q), backend=capture, device=p.device).capture()

    @property
    def live(self) -> int:
        return len(self.slots)

    def kv_bytes(self) -> int:
        """Bytes of this rank's V4 cache storage (window rings and compressed entries, every slot; 0 outside the
        DCP group)."""
        return 0 if self.holder is None else self.holder.kv_bytes()

    def release(self, req_ids) -> None:
        """Drop the state of ``req_ids`` (finished, aborted or preempted: a readmission recomputes it)."""
        for rid in req_ids:
            slot = self.slots.pop(rid, None)
            if slot is None:
                continue
            self._free.append(slot)
            if self.holder is None:  # outside the DCP group: no state to drop
                continue
            c = self.holder.cache
            _poison_slot(c, slot)
            lens, high = list(c.seq_lens), list(c.high_water)
            lens[slot] = high[slot] = 0
            self.holder.cache = replace(c, seq_lens=tuple(lens), high_water=tuple(high))

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one scheduled step on this rank (every rank of the group, the same ``out``)."""
        self.release([*out.preempted, *out.finished])
        if not out.req_ids:
            return StepResult({}, {}, False, 0)
        sent, t0 = self._sent(), time.perf_counter()
        self.chunk_logits = {} if self.prompt_logits else None
        pre = [b for b, p in enumerate(out.is_prefill) if p]
        dec = [b for b, p in enumerate(out.is_prefill) if not p]
        outputs, logits = {}, {}
        self._hidden = {} if self.hidden_layers is not None else None  # this step's, filled by _prefill / _decode
        times = [0.0, 0.0, 0.0]
        if pre:
            o, lg, tm = self._prefill(out, pre)
            outputs.update(o), logits.update(lg)
            times = [a + b for a, b in zip(times, tm)]
        replayed = False
        by_q: dict[int, list[int]] = {}
        for b in dec:
            by_q.setdefault(out.query_lens[b], []).append(b)
        for q, rows in by_q.items():
            o, lg, tm, r = self._decode(out, rows, q, graph=not pre and len(by_q) == 1)
            outputs.update(o), logits.update(lg)
            times = [a + b for a, b in zip(times, tm)]
            replayed = replayed or r
        return StepResult(outputs, logits, replayed, self._sent() - sent, *times,
                          len(pre) if self.pcp_size > 1 else 0, self._hidden, chunk_logits=self.chunk_logits)

    def _sent(self) -> int:
        """Bytes this rank sent so far, over the world, the DCP group and a PCP group (each counted once)."""
        groups = {id(g): g for g in (self.world, self.group, self.prefill_group) if g is not None}
        return sum(g.stats.total_sent() for g in groups.values())

    def _prefill(self, out: SchedulerOutput, rows: list[int]):
        """Prefill each row's whole query (context 0), seed its slot, sample its first token."""
        t0 = time.perf_counter()
        for b in rows:
            if out.context_lens[b] or not out.samples[b]:
                raise ValueError(f"request {out.req_ids[b]!r}: a {self.family.name} prefill must be one whole chunk "
                                 f"from position 0 (got {out.query_lens[b]} tokens after {out.context_lens[b]}); "
                                 "build the scheduler without chunked prefill and prefix caching")
        rids = [out.req_ids[b] for b in rows]
        self.release([r for r in rids if r in self.slots])  # a recompute starts over
        if len(self._free) < len(rids):
            raise RuntimeError(f"{len(rids)} new requests but {len(self._free)} free V4 cache slots; the scheduler "
                               "ran more requests than max_num_seqs")
        take = getattr(self.connector, "take", None)  # V4 P/D consumer: states handed over, not computed
        handed = {b: got for b in rows if take is not None
                  and (got := take(out.req_ids[b], self.group.rank, out.query_lens[b])) is not None}
        if handed:
            outputs, logits, times = self._place(out, list(handed), handed)
            rows = [b for b in rows if b not in handed]
            if not rows:
                return outputs, logits, times
            o, lg, tm = self._prefill(out, rows)
            return {**outputs, **o}, {**logits, **lg}, [a + b for a, b in zip(times, tm)]
        slots = [self._free.pop(0) for _ in rids]
        t1 = time.perf_counter()
        res = prefill_slots(self, [list(out.input_ids[b]) for b in rows], slots,
                            prompt_logits=self.chunk_logits is not None)  # runner_v4_pcp: every DCP rank's share
        cu = cu_seqlens([out.query_lens[b] for b in rows])
        if self.chunk_logits is not None:  # [T, V] request order: each prompt's rows
            self.chunk_logits.update({rid: res.prompt_logits[cu[j]:cu[j + 1]] for j, rid in enumerate(rids)})
        if self._hidden is not None:  # {name: [T, ...]} request order (gathered under PCP): every prompt row
            self._hidden.update({rid: {n: h[cu[j]:cu[j + 1]] for n, h in res.hidden.items()}
                                 for j, rid in enumerate(rids)})
        collected = res.collected
        self.slots.update(zip(rids, slots))
        stage = getattr(self.connector, "stage", None)  # V4 P/D producer: the consumer gets this state
        if stage is not None:
            for j, rid in enumerate(rids):
                stage(rid, collected, j, res.first[j], self.group.rank)
        t2 = time.perf_counter()
        first = res.first  # [B, V]
        chosen = _sample(out, rows, first, first.argmax(-1).tolist(), last_only=True)
        outputs = {rid: ModelOutput((chosen[j],)) for j, rid in enumerate(rids)}
        logits = {rid: first[j:j + 1] for j, rid in enumerate(rids)}
        return outputs, logits, [t1 - t0, t2 - t1, time.perf_counter() - t2]

    def _place(self, out: SchedulerOutput, rows: list[int], handed: dict):
        """Prefill rows whose state the P/D producer handed over (``handed[b]`` = (this rank's share,
        first-token logits [V])): placed in fresh slots, the first token sampled from the logits."""
        from cpattn.v4.share import place_share

        t0 = time.perf_counter()
        rids = [out.req_ids[b] for b in rows]
        if self._hidden is not None:  # a drafter's: the producer's rows of every prompt position, handed over
            self._hidden.update({rid: handed_hidden(self.connector, rid, 0, out.query_lens[b])
                                 for rid, b in zip(rids, rows)})
        slots = [self._free.pop(0) for _ in rids]
        for b, s in zip(rows, slots):
            self.holder.cache = place_share(self.holder.cache, s, out.query_lens[b], handed[b][0])
        self.slots.update(zip(rids, slots))
        first = torch.stack([handed[b][1] for b in rows])  # [B, V]
        t1 = time.perf_counter()
        chosen = _sample(out, rows, first, first.argmax(-1).tolist(), last_only=True)
        outputs = {rid: ModelOutput((chosen[j],)) for j, rid in enumerate(rids)}
        logits = {rid: first[j:j + 1] for j, rid in enumerate(rids)}
        return outputs, logits, [t1 - t0, 0.0, time.perf_counter() - t1]

    def _decode(self, out: SchedulerOutput, rows: list[int], q: int, *, graph: bool):
        """Decode rows of query length q (the last token + q - 1 drafts) in one call of the decode program."""
        t0 = time.perf_counter()
        rids = [out.req_ids[b] for b in rows]
        slots = [self.slots[r] for r in rids]
        ctx = [out.context_lens[b] for b in rows]
        held = ctx if self.holder is None else [self.holder.cache.seq_lens[s] for s in slots]
        if held != ctx:
            raise RuntimeError(f"requests {rids}: the V4 cache holds {held} tokens but the step continues after {ctx}")
        tokens = torch.tensor([t for b in rows for t in out.input_ids[b]], dtype=torch.int64)
        batch = None if self.program is None else self.program.batch(slots, ctx, tokens)
        t1 = time.perf_counter()
        replayed, res = False, None  # res None outside the DCP group: DCP rank 0's outputs below
        if graph and self.graph is not None and q == self.graph.q_len:  # (no graph outside the DCP group)
            res = self.graph(batch, [q] * len(rows))
            replayed = self.graph.stats.last.startswith("graph")
        elif batch is not None:
            cu = torch.arange(0, (len(rows) + 1) * q, q, dtype=torch.int32)
            res = self.program.step(self.program.state, {**batch, "cu_seqlens_q": cu})
        if self.world is not self.group:  # PCP wider than the DCP group: every rank takes DCP rank 0's outputs
            res = step_from_rank0(self.world, res, self.hidden_layers)
        logits, greedy = res[0], res[1]
        full = res[2] if self.hidden_layers is not None else None  # {name: [A * q, ...]}, outputs of the step
        t2 = time.perf_counter()
        chosen = _sample(out, rows, logits, greedy.tolist())
        outputs, kept, rows_logits = {}, [], {}
        for i, b in enumerate(rows):
            drafts = out.draft_tokens[b]
            g = chosen[i * q:(i + 1) * q]  # the target's choice after the last token and each draft
            a = 0
            while a < len(drafts) and drafts[a] == g[a]:
                a += 1
            outputs[rids[i]] = ModelOutput(tuple(g[:a + 1]))
            rows_logits[rids[i]] = logits[i * q:i * q + a + 1]
            if full is not None:  # the last token's and the accepted drafts' rows: [1 + a, ...]
                self._hidden[rids[i]] = {n: h[i * q:i * q + a + 1] for n, h in full.items()}
            kept.append(ctx[i] + 1 + a)
        if self.program is not None:
            self.program.commit(slots, kept)
        return outputs, rows_logits, [t1 - t0, t2 - t1, time.perf_counter() - t2], replayed
