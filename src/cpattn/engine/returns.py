"""What the step loop hands back per request beyond its tokens: logprobs, and (opt-in) raw logits.

Three kinds, each collected step by step from the runner's :class:`~cpattn.engine.runner.StepResult`:

- **logprobs** (a request's ``SamplingParams.logprobs = N``): per output token, ``{token: logprob}`` of
  the sampled token and the N most likely ones (:func:`~cpattn.engine.sampling.token_logprobs`);
- **logits** (``LLMEngine(return_logits=True)``): per output token, the raw logits row [V] it was
  chosen from (``StepResult.logits``): ``RequestOutput.logits`` [n, V] for the n tokens so far;
- **prompt logits** (``LLMEngine(return_prompt_logits=True)``): the logits of every prompt position the
  engine computed, in position order (``StepResult.chunk_logits``, a prefill chunk's every row): row j
  of ``RequestOutput.prompt_logits`` [m, V] is position ``P - m + j`` of the P-token prompt, so its
  last row is the one the first output token came from. m = P unless a prefix of the prompt was found
  cached (prefix cache, KV pool) and never computed by this engine -- a cached block has no logits;
  vLLM skips the prefix cache for ``prompt_logprobs`` requests for the same reason. Turn prefix caching
  off for the whole prompt's rows. Chunked prefill and PCP hand each chunk's rows over as they are
  computed; a recompute after preemption overwrites the positions it computes again.

Neither kind of logits costs anything when off: the runner computes the chunk rows only when asked
(``StepRunner.prompt_logits``; under PCP a prefill then gathers every row's logits), and the engine keeps
rows only of what it was asked. Kept rows are clones (a replayed graph's logits are its output buffer).
Logits are float32 (float64 in a float64 run), as the step returns them.

Example
-------
>>> import torch
>>> from cpattn.engine.step_types import Request, SchedulerOutput
>>> r = Returns(logits=True, prompt_logits=True)
>>> r.add(0, None)
>>> req = {0: Request(0, [5, 6, 7], 3, 4, frozenset())}
>>> out = SchedulerOutput(req_ids=(0,), query_lens=(3,), context_lens=(0,), seq_lens=(3,), is_prefill=(True,))
>>> had = r.before(out, req)
>>> req[0].tokens.append(9)   # the scheduler commits the sampled token
>>> rows = torch.arange(12.).view(3, 4)  # [3 prompt positions, V = 4]
>>> r.after(had, req, {0: rows[2:]}, {0: rows}, out)
>>> lp, logits, prompt = r.fields(0, False, 3)
>>> lp, logits.tolist(), prompt.shape
(None, [[8.0, 9.0, 10.0, 11.0]], torch.Size([3, 4]))
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from cpattn.engine.sampling import token_logprobs


class _PromptRows:
    """One request's prompt rows: positions ``start .. start + n - 1`` (n = rows so far), as chunks."""

    __slots__ = ("start", "parts", "n", "done")

    def __init__(self, start: int) -> None:
        self.start, self.parts, self.n, self.done = start, [], 0, None

    def put(self, first: int, rows: torch.Tensor) -> None:
        """Rows of positions ``first ..`` (a chunk): appended, or overwriting a recomputed tail."""
        end = self.start + self.n
        if not self.start <= first <= end:  # a gap (a span another request computed) or before the start
            self.start, self.parts, self.n = first, [], 0
        elif first < end:  # a recompute: keep positions before ``first`` only
            kept = torch.cat(self.parts)[:first - self.start] if self.parts else rows[:0]
            self.parts, self.n = [kept], kept.shape[0]
        self.parts.append(rows)
        self.n += rows.shape[0]
        self.done = None

    def rows(self) -> torch.Tensor:
        if self.done is None:
            self.done = torch.cat(self.parts)
            self.parts = [self.done]
        return self.done


class Returns:
    """Per-request logprobs / logits / prompt logits of a step loop (module docstring).

    logits, prompt_logits: keep every request's output-token logits / prompt logits."""

    def __init__(self, logits: bool = False, prompt_logits: bool = False) -> None:
        self.logits, self.prompt_logits = bool(logits), bool(prompt_logits)
        self._num_logprobs: dict[Hashable, int] = {}  # requests that asked for logprobs: their N
        self._logprobs: dict[Hashable, list[dict[int, float]]] = {}
        self._rows: dict[Hashable, list[torch.Tensor]] = {}  # output-token logits rows, as chunks
        self._prompt: dict[Hashable, _PromptRows] = {}

    def add(self, rid: Hashable, num_logprobs: int | None) -> None:
        """A new request (``num_logprobs``: its ``SamplingParams.logprobs``)."""
        if num_logprobs is not None:
            self._logprobs[rid], self._num_logprobs[rid] = [], num_logprobs
        if self.logits:
            self._rows[rid] = []

    def drop(self, rid: Hashable) -> None:
        """Forget a request (aborted or finished)."""
        for d in (self._logprobs, self._num_logprobs, self._rows, self._prompt):
            d.pop(rid, None)

    def before(self, out, requests) -> dict | None:
        """Before the scheduler commits step ``out``: ``{req_id: output tokens so far}`` of the rows whose
        new tokens are kept, or None when nothing is kept."""
        if not (self._logprobs or self.logits or self.prompt_logits):
            return None
        keep = self._rows if self.logits else self._logprobs
        return {rid: len(requests[rid].output) for rid in out.req_ids if rid in keep or rid in self._logprobs}

    def after(self, had: dict | None, requests, logits, chunk_logits: dict | None, out) -> None:
        """After the commit: append what step ``out`` gave each request. ``logits[req_id]`` [n, V]: the rows
        its sampled tokens came from; ``chunk_logits[req_id]`` [q, V]: every row of its prefill chunk."""
        if had is None:
            return
        for rid, n in had.items():
            new = requests[rid].output[n:]
            if not new:
                continue
            rows = logits[rid][:len(new)]
            if rid in self._logprobs:
                self._logprobs[rid] += token_logprobs(rows, new, self._num_logprobs[rid])
            if rid in self._rows:
                self._rows[rid].append(rows.clone())
        if self.prompt_logits and chunk_logits:
            for b, rid in enumerate(out.req_ids):
                rows = chunk_logits.get(rid)
                if rows is None:
                    continue
                c, p = out.context_lens[b], requests[rid].num_prompt
                if c >= p:
                    continue  # a recompute's rows past the prompt
                held = self._prompt.get(rid)
                if held is None:
                    held = self._prompt[rid] = _PromptRows(c)
                held.put(c, rows[:p - c].clone())

    def fields(self, rid: Hashable, finished: bool, num_prompt: int) -> tuple:
        """``(logprobs, logits, prompt_logits)`` of a RequestOutput (None where not kept; prompt logits
        once the prompt's last position is computed); a finished request is forgotten."""
        lp = tuple(self._logprobs[rid]) if rid in self._logprobs else None
        logits = None
        if rid in self._rows:
            parts = self._rows[rid]
            if len(parts) > 1:
                parts[:] = [torch.cat(parts)]
            logits = parts[0] if parts else None
        held = self._prompt.get(rid)
        prompt = held.rows() if held is not None and held.start + held.n == num_prompt else None
        if finished:
            self.drop(rid)
        return lp, logits, prompt
