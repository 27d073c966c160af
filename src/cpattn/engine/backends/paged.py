"""The paged cache backend: per-token KV rows in a DCP-sharded paged cache (every family but DeepSeek-V4).

It wraps the engine's paged code paths behind the
:class:`~cpattn.engine.backend.CacheBackend` seam: the PCP / DSA-CP prefill
(:func:`cpattn.engine.prefill.prefill`), :class:`~cpattn.engine.paged_cache.PagedShard`,
the hand-off of rows (:func:`handoff`: all-to-all / all-gather between
engines on the same ranks) or whole blocks (P/D: :func:`~cpattn.engine.handoff.send_blocks`
/ :func:`~cpattn.engine.handoff.recv_blocks`), and the decode step
(:func:`cpattn.engine.decode.decode_step`) as a :class:`PagedProgram`.

Example
-------
>>> import torch, cpattn
>>> from cpattn.engine.batch import Prompts
>>> from cpattn.models.family import get_family
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> fam, params, p = get_family("qwen3"), qwen3.init_params(cfg), Prompts.of([[1, 2, 3]])
>>> def rank(g):
...     out = PAGED.prefill(g, fam, params, cfg, p, algorithms=Algorithms(), prompt_logits=False, prefix=None,
...                         hidden_layers=None)
...     return PAGED.collect(g, out).positions.tolist()
>>> cpattn.simulate(2, rank)[0]
[0, 1, 2]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.engine.decode import cache_capacity, decode_step, step_fields
from cpattn.models.family import param_dtype
from cpattn.engine.handoff import (
    HandoffFacts, exchange, place_blocks, place_rows, recv_blocks, request_blocks, send_blocks,
)
from cpattn.engine.kv_rows import row_width
from cpattn.engine.options import Algorithms
from cpattn.engine.paged_cache import PagedShard
from cpattn.engine.prefill import PrefillOut, gather_unshard, prefill
from cpattn.engine.prefill_steps import Prefix
from cpattn.layout.rows import cu_seqlens, request_of
from cpattn.dcp.layer_merges import ENGINE_MERGE


def request_order(plan, total: int, context_lens: tuple[int, ...]):
    """Request [T] and position [T] of a plan's ``total`` new tokens, in request order.

    >>> from cpattn import pcp_plan
    >>> [x.tolist() for x in request_order(pcp_plan([0, 2, 3], 2), 3, (4, 0))]
    [[0, 0, 1], [4, 5, 0]]
    """
    cu = plan.cu_seqlens.tolist()
    req = request_of(cu)
    pos = torch.arange(total) - torch.tensor(cu[:-1])[req] + torch.tensor(context_lens or [0] * (len(cu) - 1))[req]
    return req, pos


@dataclass(frozen=True)
class Rows:
    """What a paged prefill leaves for the decode caches: ``rows`` [T, F] (request order) with each row's
    ``requests`` [T] and ``positions`` [T]."""

    rows: torch.Tensor
    requests: torch.Tensor
    positions: torch.Tensor


def handoff(world: Group, pg: Group, dg: Group, shard: PagedShard, out: PrefillOut,
            algorithms: Algorithms = Algorithms(), prefix: Prefix | None = None) -> HandoffFacts:
    """Put the prefill rows of ``out`` into this rank's decode shard (engines on the same ranks).

    pg / dg: this rank's prefill and decode groups (:func:`cpattn.engine.driver.stage_group`).
    prefix: the cached prefix the prefill started from (every rank holds it);
    each decode rank keeps the prefix rows it owns.
    """
    pcp_size, dcp_size = pg.size, dg.size
    if prefix is not None:
        ctx = prefix.context_lens
        req = request_of(cu_seqlens(ctx))
        pos = torch.cat([torch.arange(c) for c in ctx]) if sum(ctx) else torch.zeros(0, dtype=torch.int64)
        place_rows(shard, prefix.rows, req, pos, rank=dg.rank, dcp_size=dcp_size)
    if pcp_size > 1 and dcp_size > 1:  # both over the world: rows go straight to their owners
        rows, req, pos, facts = exchange(world, out.rows, out.plan, pcp_size=pcp_size, dcp_size=dcp_size,
                                         interleave_size=shard.interleave_size, width=row_width(shard.layouts),
                                         dtype=out.rows.dtype, method=algorithms.handoff)
        place_rows(shard, rows, req, pos, rank=dg.rank, dcp_size=dcp_size)
        return facts
    before = pg.stats.total_sent()
    rows = gather_unshard(pg, out.rows, out.plan)  # [T, F] request order, on every rank
    req, pos = request_order(out.plan, rows.shape[0], out.plan.context_lens)
    place_rows(shard, rows, req, pos, rank=dg.rank, dcp_size=dcp_size)
    return HandoffFacts(rows_kept=rows.shape[0], bytes_sent=pg.stats.total_sent() - before)


class PagedProgram:
    """The paged decode program: :func:`~cpattn.engine.decode.decode_step` over ``shard``, its inputs
    ``tokens``, ``seq_lens`` and ``block_table`` rows (:func:`~cpattn.engine.decode.step_fields`); nothing
    to commit (rejected drafts' rows lie past ``seq_lens`` and are overwritten)."""

    def __init__(self, family, cfg: Any, group: Group, params: dict, shard: PagedShard, *, merge: str = ENGINE_MERGE,
                 hidden_layers: tuple | None = None):
        self.shard = shard
        self.step = functools.partial(decode_step, family=family, cfg=cfg, group=group, merge=merge,
                                      hidden_layers=hidden_layers)
        self.state = {"params": params, "shard": shard}
        self.fields = step_fields(shard.block_table.shape[1])
        self.device = shard.block_table.device

    def batch(self, requests: list[int], context_lens: list[int], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """``tokens`` [A * q] after ``context_lens`` cached tokens of ``requests``: seq_lens [A] and block_table [A, M]."""
        q = tokens.numel() // max(len(requests), 1)
        return {"tokens": tokens, "seq_lens": torch.tensor([c + q for c in context_lens]),
                "block_table": self.shard.block_table[list(requests)]}

    def commit(self, requests: list[int], seq_lens: list[int]) -> None:
        """Nothing to do: the next step's ``seq_lens`` hide the rejected rows."""


class PagedBackend:
    """The ``"paged"`` cache kind (module doc)."""

    name = "paged"
    per_token_kv = True

    def prefill(self, group: Group, family, params: dict, cfg: Any, prompts, *, algorithms: Algorithms = Algorithms(),
                prompt_logits: bool = False, prefix: Prefix | None = None, hidden_layers=None) -> PrefillOut:
        return prefill(group, family, params, cfg, prompts, algorithms=algorithms, prompt_logits=prompt_logits,
                       prefix=prefix, hidden_layers=hidden_layers)

    def new_cache(self, family, cfg: Any, params: dict, prompts, steps: int, decode_cfg, num_speculative_tokens: int,
                  group: Group | None = None) -> PagedShard:
        return PagedShard.empty(family.kv_layouts(cfg),
                                capacity=cache_capacity(list(prompts.prompt_lens), steps, num_speculative_tokens),
                                dcp_size=decode_cfg.parallel.dcp_size, block_size=decode_cfg.cache.block_size,
                                interleave_size=decode_cfg.cache.cp_kv_cache_interleave_size,
                                dtype=param_dtype(params))

    def collect(self, prefill_group: Group, out: PrefillOut) -> Rows:
        rows = gather_unshard(prefill_group, out.rows, out.plan)  # [T, F] request order
        return Rows(rows, *request_order(out.plan, rows.shape[0], out.plan.context_lens))

    def place(self, cache: PagedShard, collected: Rows, decode_group: Group) -> None:
        place_rows(cache, collected.rows, collected.requests, collected.positions, rank=decode_group.rank,
                   dcp_size=decode_group.size)

    def handoff(self, world: Group, prefill_group: Group, decode_group: Group, cache: PagedShard, out: PrefillOut,
                algorithms: Algorithms = Algorithms(), prefix: Prefix | None = None) -> HandoffFacts:
        return handoff(world, prefill_group, decode_group, cache, out, algorithms, prefix)

    def send(self, world: Group, prefill_group: Group, out: PrefillOut, decode_ranks: list[int],
             block_size: int) -> HandoffFacts:
        """Every prefill rank: whole blocks of the request-order rows (any prefill rank sends any block),
        block j of a request to decode rank j % N; prefill rank 0 with the first-token logits. A prefill
        from a cached prefix (whole blocks, which the decode ranks hold) sends only the blocks after it."""
        rows = gather_unshard(prefill_group, out.rows, out.plan)
        blocks = request_blocks(rows, out.plan.cu_seqlens.tolist(), block_size)
        start = [c // block_size for c in out.plan.context_lens] if out.plan.context_lens else None
        return send_blocks(blocks, out.first_logits if prefill_group.rank == 0 else None,
                           prefill_rank=prefill_group.rank, pcp_size=prefill_group.size,
                           decode_ranks=decode_ranks, world=world, start=start)

    def recv(self, world: Group, cache: PagedShard, prompts, cfg: Any, *, prefill_ranks: list[int],
             decode_group: Group, dtype: torch.dtype, start: list[int] | None = None):
        """``start``: per request, the whole blocks this rank holds already (a cached prefix): not sent."""
        received, first, facts = recv_blocks(list(prompts.prompt_lens), decode_rank=decode_group.rank,
                                             dcp_size=decode_group.size, prefill_ranks=prefill_ranks,
                                             block_size=cache.block_size, width=row_width(cache.layouts),
                                             dtype=dtype, vocab_size=cfg.vocab_size, world=world, start=start)
        place_blocks(cache, received)
        return first, facts

    def program(self, group: Group, family, params: dict, cfg: Any, cache: PagedShard, *, merge: str = ENGINE_MERGE,
                hidden_layers: tuple | None = None) -> PagedProgram:
        return PagedProgram(family, cfg, group, params, cache, merge=merge, hidden_layers=hidden_layers)


PAGED = PagedBackend()
