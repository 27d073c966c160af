"""The scheduler's vocabulary of one step: a row's :class:`ModelOutput`, the step's :class:`SchedulerOutput`,
the :class:`SchedulerStats` counters and a :class:`Request`'s state (importable from
:mod:`cpattn.engine.scheduler` too, their first home).

>>> out = SchedulerOutput(req_ids=(7,), query_lens=(1,), context_lens=(5,), seq_lens=(6,), is_prefill=(False,))
>>> out.uniform_decode, out.num_scheduled_tokens
(True, 1)
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelOutput:
    """What the runner returns for one scheduled row: ``sampled`` -- the accepted drafts then the
    bonus token (one token for a plain decode or a completed prefill, none for a partial chunk) --
    and the ``drafts`` it proposes for the request's next step."""

    sampled: Sequence[int] = ()
    drafts: Sequence[int] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """One step, row b per scheduled request, in the vocabulary of :mod:`cpattn.engine.batch`:
    ``query_lens[b]`` tokens computed on top of ``context_lens[b]`` cached ones,
    ``seq_lens = context_lens + query_lens``; ``input_ids[b]`` the query's tokens (its
    ``draft_tokens[b]`` last); ``block_tables[b]`` the block ids covering ``seq_lens[b]``;
    ``is_prefill[b]`` (a prompt chunk or a recompute, else a decode); ``samples[b]`` whether the
    row's last position is sampled (False for a partial chunk); requests ``preempted`` this step
    and ``finished`` (or aborted) since the previous one; ``fresh_blocks``: block ids handed out as
    new blocks since the previous step (stale rows: never read before this step writes them);
    ``loads[b]``: ``(block_id, payloads)`` pairs the runner writes before the step -- spans found in
    the second tier (the KV pool), one payload [block_size, F] per DCP rank; ``sampling[b]``: the
    request's sampling parameters (what ``add_request`` was given: the engine passes a sampled
    request's :class:`~cpattn.engine.sampling.SamplingParams`, None for a greedy one) and ``num_output[b]``: its
    output tokens so far (the index its next sampled token gets). Empty tuples: every row greedy."""

    req_ids: tuple = ()
    query_lens: tuple[int, ...] = ()
    context_lens: tuple[int, ...] = ()
    seq_lens: tuple[int, ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()
    input_ids: tuple[tuple[int, ...], ...] = ()
    draft_tokens: tuple[tuple[int, ...], ...] = ()
    is_prefill: tuple[bool, ...] = ()
    samples: tuple[bool, ...] = ()
    preempted: tuple = ()
    finished: tuple = ()
    fresh_blocks: tuple[int, ...] = ()
    loads: tuple = ()
    sampling: tuple = ()
    num_output: tuple[int, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(self.query_lens)

    @functools.cached_property
    def eager_reason(self) -> str | None:
        """Why this step cannot replay a captured decode graph (FULL_DECODE_ONLY), or None if it can."""
        if not self.req_ids:
            return "empty step"
        for b, p in enumerate(self.is_prefill):
            if p:
                return f"row {b} (request {self.req_ids[b]!r}) is a prefill chunk"
        if len(set(self.query_lens)) > 1:
            return f"decode query lengths differ: {sorted(set(self.query_lens))}"
        return None

    @property
    def uniform_decode(self) -> bool:
        """Every row a decode of the same query length (graph-replayable); see :attr:`eager_reason`."""
        return self.eager_reason is None


@dataclass(frozen=True)
class SchedulerStats:
    """Counters since the start: steps scheduled (``uniform_decode_steps`` of them replayable),
    preemptions, prefix-cache hit / query tokens, KV blocks used / free, queue lengths."""

    steps: int
    uniform_decode_steps: int
    preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    blocks_used: int
    blocks_free: int
    running: int
    waiting: int


@dataclass
class Request:
    """One request's state: ``tokens`` = prompt then outputs; ``num_computed`` tokens have KV."""

    req_id: Hashable
    tokens: list[int]
    num_prompt: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None  # stop | length | abort
    num_preemptions: int = 0
    loads: tuple = ()  # second-tier spans to write before its next step
    sampling: object = None  # the request's sampling parameters, handed to the runner per row

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt:]
