"""A deterministic step scheduler (host side, pure Python): which tokens of which requests run each step.

Policies (vLLM V1's ``Scheduler.schedule``; facts carried over, code ours):

- **Order.** Running requests first, in the order they were admitted: each
  gets its next tokens -- a decode (the last sampled token plus up to k
  draft tokens) or the next chunk of an unfinished prefill. Then waiting
  requests are admitted first-come first-served while the token budget, the
  sequence cap and the KV blocks last; the first that does not fit stops
  admission (no skipping ahead). A step that preempted admits nobody.
- **Budget.** At most ``max_num_batched_tokens`` query tokens per step and at
  most ``max_num_seqs`` running requests.
- **Chunked prefill.** With ``enable_chunked_prefill`` a prompt longer than
  the remaining budget is split; the rest continues next step (each chunk
  attends the chunks before it, already cached). Without it a request that
  does not fit the remaining budget waits, and one that could never fit one
  step -- ``prompt + max_tokens - 1`` tokens, its longest recompute -- is
  refused by :meth:`Scheduler.add_request`.
- **Preemption by recompute.** When a running request cannot get a block,
  the most recently admitted running request (the end of the running list)
  is preempted -- its blocks freed, its progress dropped, put back at the
  front of the waiting queue -- until the block fits or the request itself
  was the one preempted. It later recomputes prompt and outputs as a prefill
  (its own freed blocks may still be prefix-cache hits).
- **Prefix caching** (:mod:`cpattn.engine.blocks`): a request admitted with
  nothing computed starts from its longest cached prefix of full blocks,
  always leaving at least one token to compute; with a second tier (``tier2``,
  the KV pool: :class:`cpattn.engine.pool_tier.PoolTier`) the spans after
  the cached ones are fetched from it into fresh blocks (``loads``). Full blocks are cached when
  the update commits them (their KV is written and, for drafts, accepted).
- **Speculative decoding.** A decode schedules ``1 + k`` tokens, k = the
  drafts the runner proposed in the last update, capped by
  ``num_speculative_tokens``, by the tokens left to ``max_tokens`` and by
  the budget. The update commits accepted drafts plus the bonus token; the
  blocks past the new computed length (rejected drafts' KV) are released.

The engine's step loop (:class:`cpattn.engine.llm.LLMEngine`) runs it with :class:`cpattn.engine.runner.StepRunner`.

Example
-------
>>> from cpattn.engine.blocks import BlockManager
>>> s = Scheduler(BlockManager(num_blocks=8, block_size=4), max_num_batched_tokens=6, max_num_seqs=4)
>>> a = s.add_request([1, 2, 3, 4, 5], max_tokens=2)
>>> b = s.add_request([6, 7, 8], max_tokens=1)
>>> out = s.schedule()                       # a's whole prompt (5) + 1 token of b's (chunked)
>>> out.req_ids, out.query_lens, out.context_lens, out.is_prefill, out.eager_reason
((0, 1), (5, 1), (0, 0), (True, True), 'row 0 (request 0) is a prefill chunk')
>>> s.update({a: ModelOutput([9]), b: ModelOutput()})   # a samples; b's partial chunk does not
[]
>>> out = s.schedule()                       # a decodes first, then b's last 2 prompt tokens
>>> out.req_ids, out.query_lens, out.context_lens, out.seq_lens
((0, 1), (1, 2), (5, 1), (6, 3))
>>> s.update({a: ModelOutput([10]), b: ModelOutput([11])}), s.output_tokens(a), s.has_unfinished()
([0, 1], [9, 10], False)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence

from cpattn.engine import decode_rows
from cpattn.engine.blocks import BlockManager
from cpattn.engine.step_types import ModelOutput, Request, SchedulerOutput, SchedulerStats  # noqa: F401 - public here



class Scheduler:
    """Waiting / running queues over one :class:`~cpattn.engine.blocks.BlockManager` (policies: module docstring).

    Call :meth:`schedule`, run the step, then :meth:`update` with its outputs, once per step.
    ``fast_paths``: a step of one-token decodes is built and committed by :mod:`cpattn.engine.decode_rows`
    (the same result; False: the general code, which the tests compare it with); the steady case -- the
    previous decode step's requests again, nothing to admit -- is built without the general loop.
    """

    fast_paths = True

    def __init__(self, blocks: BlockManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 enable_chunked_prefill: bool = True, num_speculative_tokens: int = 0, tier2=None) -> None:
        for name, v, lo in (("max_num_batched_tokens", max_num_batched_tokens, 1),
                            ("max_num_seqs", max_num_seqs, 1), ("num_speculative_tokens", num_speculative_tokens, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}; got {v!r}")
        self.blocks = blocks
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.enable_chunked_prefill, self.num_speculative_tokens = enable_chunked_prefill, num_speculative_tokens
        self.tier2 = tier2  # .fetch(tokens, start_span, stop_span) -> [per-rank payloads] of the next spans
        self.tier2_hit_tokens = 0
        self.requests: dict[Hashable, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_id = 0
        self._finished_since: list[Hashable] = []
        self._pending: SchedulerOutput | None = None
        self._last_decode: SchedulerOutput | None = None  # the latest step decode_rows built
        self._last_changes = -1  # blocks.changes when it was built (decode_rows.steady_output)
        self._steady: SchedulerOutput | None = None  # that step, committed one token a row, nothing finished
        self._committed: Sequence[int] = ()  # the tokens it committed
        self._steps = self._uniform = self._preemptions = 0

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], *, max_tokens: int = 16, stop_token_ids: Sequence[int] = (),
                    req_id: Hashable | None = None, sampling: object = None) -> Hashable:
        """Queue a request (at the back of the waiting queue); returns its id (0, 1, ... unless given).
        ``sampling``: carried to the runner in each of its rows (``SchedulerOutput.sampling``)."""
        rid = self._next_id if req_id is None else req_id
        if rid in self.requests:
            raise ValueError(f"req_id {rid!r} is already used; give each request its own id")
        tokens = list(prompt)
        if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ValueError(f"prompt of request {rid!r} must be a non-empty sequence of int token ids")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens of request {rid!r} must be an int >= 1; got {max_tokens!r}")
        longest = len(tokens) + max_tokens - 1  # tokens with KV at the last step (drafts never exceed it)
        if self.blocks.blocks_for(longest) > self.blocks.num_blocks:
            raise ValueError(f"request {rid!r} needs {self.blocks.blocks_for(longest)} KV blocks at its longest "
                             f"({len(tokens)} prompt + {max_tokens} max_tokens - 1 = {longest} tokens); the pool "
                             f"has {self.blocks.num_blocks}: raise num_blocks or lower max_tokens")
        if not self.enable_chunked_prefill and longest > self.max_num_batched_tokens:
            raise ValueError(f"request {rid!r} may need {longest} tokens in one step ({len(tokens)} prompt + "
                             f"{max_tokens} max_tokens - 1, its recompute after a preemption) but "
                             f"max_num_batched_tokens is {self.max_num_batched_tokens}: enable chunked prefill "
                             "or raise max_num_batched_tokens")
        if req_id is None:
            self._next_id += 1
        req = Request(rid, tokens, len(tokens), max_tokens, frozenset(stop_token_ids), sampling=sampling)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, req_id: Hashable) -> bool:
        """Stop a waiting or running request now (its blocks freed); False if it already finished."""
        req = self.requests.get(req_id)
        if req is None:
            raise ValueError(f"req_id {req_id!r} is not a request of this scheduler")
        if req.status == "finished":
            return False
        if req.status == "waiting":
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self._steady = None  # the running list changed
        self._finish(req, "abort")
        return True

    def output_tokens(self, req_id: Hashable) -> list[int]:
        return self.requests[req_id].output

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def stats(self) -> SchedulerStats:
        b = self.blocks.stats
        return SchedulerStats(self._steps, self._uniform, self._preemptions, b.hit_tokens, b.query_tokens,
                              b.used, b.free, len(self.running), len(self.waiting))

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's rows (see the module docstring for the order and the rules)."""
        if self._pending is not None and self._pending.req_ids:
            raise ValueError("schedule() called twice: call update() with the last step's outputs first")
        out = self.fast_paths and decode_rows.steady_output(self)  # the last decode step again, one token on
        if out:
            self._pending = out
            self._steps += 1
            self._uniform += 1
            return out
        budget, rows, preempted = self.max_num_batched_tokens, [], []
        running, allocate = self.running, self.blocks.allocate
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            todo = len(req.tokens) - req.num_computed
            drafts = req.drafts
            if drafts:  # only a decode verifies drafts; as many as max_tokens and the budget leave room for
                drafts = drafts[:self._max_drafts(req)] if self._is_decode(req, req.num_computed) else ()
                drafts = drafts[:max(min(todo + len(drafts), budget) - todo, 0)]
            num_new = min(todo + len(drafts), budget)
            while not allocate(req.req_id, req.num_computed + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            if req.status != "running":
                break
            rows.append((req, req.num_computed, num_new, drafts))
            budget -= num_new
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                self.blocks.extend_keys(req.keys, req.tokens)
                hit = self.blocks.lookup(req.keys, len(req.tokens))
                span, start = self.blocks.span, len(hit.block_ids)
                last = (len(req.tokens) - 1) // span  # a span past it would leave no token to compute
                fetched = [] if self.tier2 is None else self.tier2.fetch(req.tokens, start, last)
                computed = hit.num_tokens + len(fetched) * span
                todo = len(req.tokens) - computed
                if not self.enable_chunked_prefill and todo > budget:
                    break
                num_new = min(todo, budget)
                if not self.blocks.allocate(req.req_id, computed + num_new, prefix=hit):
                    break
                self.waiting.popleft()
                req.status, req.num_computed, req.drafts = "running", computed, []
                table = self.blocks.block_table(req.req_id)
                req.loads = tuple((table[start + i], f) for i, f in enumerate(fetched))
                self.tier2_hit_tokens += len(fetched) * span
                self.running.append(req)
                rows.append((req, computed, num_new, []))
                budget -= num_new
        out = (self.fast_paths and decode_rows.decode_output(self, rows, preempted)) or self._output(rows, preempted)
        self._pending = out
        self._steps += bool(out.req_ids)
        self._uniform += out.uniform_decode
        return out

    def update(self, outputs: Mapping[Hashable, ModelOutput | Sequence[int]]) -> list[Hashable]:
        """Commit the last step: ``outputs[req_id]`` for each of its rows (a :class:`ModelOutput`, or just
        the sampled tokens; or a mapping with ``one_token_per_row`` -- :class:`cpattn.engine.step_inputs.OneTokenRows`
        -- committed without per-row objects). Returns the requests that finished (max_tokens or a stop token id)."""
        step = self._pending
        if step is None:
            raise ValueError("update() without a scheduled step: call schedule() first")
        if self.fast_paths and getattr(outputs, "one_token_per_row", False) and outputs.req_ids == step.req_ids \
                and (step is self._last_decode or all(step.samples) and not any(step.draft_tokens)):
            return decode_rows.commit_one_each(self, step, outputs.tokens)  # a decode_rows step: all sampled, no drafts
        scheduled = set(step.req_ids)
        extra = [r for r in outputs if r not in scheduled]
        if extra:
            raise ValueError(f"outputs hold requests {extra!r} that the last step did not schedule")
        rows = []  # validate every row before committing any
        requests = self.requests
        for b, rid in enumerate(step.req_ids):
            req = requests[rid]
            if req.status != "running":  # aborted since the step was scheduled
                continue
            out = outputs.get(rid)
            if out is None:
                raise ValueError(f"outputs miss request {rid!r}, scheduled in row {b} of the last step")
            out = out if isinstance(out, ModelOutput) else ModelOutput(tuple(out))
            sampled, drafts = out.sampled, step.draft_tokens[b]
            n = len(sampled)
            if (n > len(drafts) + 1 or bool(n) != step.samples[b]
                    or (drafts and list(sampled[:n - 1]) != list(drafts[:n - 1]))):  # no drafts: nothing to compare
                want = f"1 to {len(drafts) + 1} tokens" if step.samples[b] else "no token (a partial prefill chunk)"
                raise ValueError(f"request {rid!r} sampled {list(sampled)}; with drafts {list(drafts)} it must get "
                                 f"{want}: the accepted drafts, in order, then one bonus token")
            rows.append((b, req, sampled, len(drafts), out.drafts))
        self._pending = None
        done = []
        caching, span, seq_lens = self.blocks.enable_caching, self.blocks.span, step.seq_lens
        for b, req, sampled, num_drafts, next_drafts in rows:
            req.num_computed = seq_lens[b] - (num_drafts - max(len(sampled) - 1, 0))  # rejected drop out
            reason = self._append(req, sampled)
            if caching:
                if len(req.tokens) // span > len(req.keys):  # a span filled up: its key
                    self.blocks.extend_keys(req.keys, req.tokens)
                self.blocks.cache_blocks(req.req_id, req.keys, req.num_computed)
            if reason:
                self.running.remove(req)
                self._finish(req, reason)
                done.append(req.req_id)
            else:
                self.blocks.trim(req.req_id, req.num_computed)
                req.drafts = list(next_drafts) if next_drafts else []
        return done

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _is_decode(req: Request, context: int) -> bool:
        """The query is the last sampled token (its drafts after it): the request has output and
        everything before that token is cached."""
        return len(req.tokens) > req.num_prompt and context == len(req.tokens) - 1

    def _max_drafts(self, req: Request) -> int:
        # drafts past max_tokens could never be kept: 1 + k tokens emitted at most
        return max(min(self.num_speculative_tokens, req.max_tokens - len(req.output) - 1), 0)

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req.req_id)
        req.status, req.num_computed, req.drafts = "waiting", 0, []
        req.num_preemptions += 1
        self._preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: str) -> None:
        self.blocks.free(req.req_id)
        req.status, req.finish_reason, req.drafts = "finished", reason, []
        self._finished_since.append(req.req_id)

    @staticmethod
    def _append(req: Request, sampled: list[int]) -> str | None:
        """Append sampled tokens up to the first stop token or max_tokens; the finish reason or None."""
        for t in sampled:
            req.tokens.append(t)
            if t in req.stop_token_ids:
                return "stop"
            if len(req.tokens) - req.num_prompt >= req.max_tokens:
                return "length"
        return None

    def _output(self, rows, preempted) -> SchedulerOutput:
        """The step's :class:`SchedulerOutput`: one pass over ``rows`` of (request, context, new tokens,
        drafts); block tables are the block manager's shared tuples (:meth:`BlockManager.table_ids`)."""
        finished, self._finished_since = tuple(self._finished_since), []
        table_ids = self.blocks.table_ids
        ids, qs, ctxs, seqs, tables, inputs, drafts, prefill, samples, loads, sampling, num_output = (
            [None] * len(rows) for _ in range(12))
        for b, (r, c, n, d) in enumerate(rows):
            toks, rid, d = r.tokens, r.req_id, tuple(d)
            total, end = len(toks), c + n - len(d)
            ids[b], qs[b], ctxs[b], seqs[b], tables[b] = rid, n, c, c + n, table_ids(rid)
            inputs[b], drafts[b] = tuple(toks[c:end]) + d if d else tuple(toks[c:end]), d
            prefill[b] = not (total > r.num_prompt and c == total - 1)  # not _is_decode(r, c)
            samples[b] = end == total
            loads[b], r.loads = r.loads, ()
            sampling[b], num_output[b] = r.sampling, total - r.num_prompt
        return SchedulerOutput(
            req_ids=tuple(ids), query_lens=tuple(qs), context_lens=tuple(ctxs), seq_lens=tuple(seqs),
            block_tables=tuple(tables), input_ids=tuple(inputs), draft_tokens=tuple(drafts),
            is_prefill=tuple(prefill), samples=tuple(samples), preempted=tuple(preempted), finished=finished,
            fresh_blocks=tuple(self.blocks.take_fresh()), loads=tuple(loads), sampling=tuple(sampling),
            num_output=tuple(num_output),
        )
