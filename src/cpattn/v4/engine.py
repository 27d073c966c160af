"""DeepSeek-V4 on the engine: the family's own cache, prefill, hand-off and decode program.

The engine's paged KV cache describes a layer by what one token leaves in
it (:class:`~cpattn.models.family.KVLayout`); V4's state is rings plus one
entry per m tokens, so the family declares its own cache kind
(``ModelFamily(..., cache="v4")``) and the engine serves it through the V4
cache backend (:class:`cpattn.engine.backends.v4.V4Backend`), which runs
these stages (:class:`V4Stages`):

- **prefill** -- :func:`cpattn.v4.prefill.v4_prefill` over the PCP group
  (halos and an entry all-gather; one rank: plain prefill);
- **cache** -- :class:`V4DecodeCache`, a :class:`~cpattn.v4.cache.V4Cache`
  with this DCP rank's share of the entries, rings replicated, rewindable
  by the speculative k;
- **hand-off** -- :func:`cpattn.v4.handoff.collect` (one all-gather of the
  tail rows over the prefill group) and :func:`~cpattn.v4.handoff.seed_cache`;
- **decode** -- :class:`V4DecodeProgram`: the step
  (:class:`~cpattn.v4.decode.V4DecodeStep` under the model's forward) and
  its host plan in static per-token buffers, so the same step runs eagerly
  or replayed by a :class:`~cpattn.graphs.DecodeRunner`; after each step
  :meth:`V4DecodeProgram.commit` rewinds the rejected drafts
  (:meth:`~cpattn.v4.cache.V4Cache.rewind`: lengths back, their rows
  poisoned with NaN).

Example
-------
>>> import torch
>>> from cpattn.engine import generate, engine_configs
>>> from cpattn.models import deepseek_v4 as v4
>>> cfg = v4.DeepseekV4Config.tiny()
>>> pre, dec = engine_configs("deepseek_v4", cfg, pcp_size=2, dcp_size=2)
>>> generate("deepseek_v4", v4.init_params(cfg), cfg, [list(range(20))], 3, prefill=pre, decode=dec).tokens.shape
torch.Size([1, 3])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.config import EngineConfig
from cpattn.layout.batch import Prompts
from cpattn.layout.dcp import HandoffFacts
from cpattn.ops.logits import param_dtype
from cpattn.ops.logits import forward_logits
from cpattn.config.algorithms import Algorithms
from cpattn.graphs.runner import Field
from cpattn.v4.cache import V4Cache, V4Layout
from cpattn.v4.decode import V4DecodeStep, cache_state, decode_plan, plan_fields
from cpattn.v4.handoff import V4Handoff, collect, recv_handoff, seed_cache, send_handoff
from cpattn.v4.prefill import V4PrefillOut, v4_prefill
from cpattn.dcp.layer_merges import ENGINE_MERGE


@dataclass
class V4DecodeCache:
    """One decode rank's V4 state: ``cache`` (replaced as its lengths move; its tensors stay put)."""

    cache: V4Cache

    def kv_bytes(self) -> int:
        """Bytes of this rank's cache storage."""
        return self.cache.kv_bytes()


def v4_decode_step(state: dict, batch: dict[str, torch.Tensor], *, forward: Callable[..., Any], cfg: Any,
                   layout: V4Layout, group: Group, interleave_size: int, hidden_layers: tuple | None = None):
    """One decode / verification step of the whole model, capturable (the plan is in ``batch``).

    state: ``{"params", "cache": cache_state(...)}``; batch: ``tokens`` [T] and
    the plan tensors of :func:`~cpattn.v4.decode.plan_fields` (plus the
    runner's ``cu_seqlens_q``, unused). Returns (logits [T, V] float32 (float64 in a float64 run),
    argmax [T]) and, with ``hidden_layers``, the hidden states.
    """
    step = V4DecodeStep(layout, state["cache"], batch, group, interleave_size=interleave_size)
    return forward_logits(forward, state["params"], cfg, batch["tokens"], step, hidden_layers=hidden_layers)


class V4DecodeProgram:
    """The decode program the engine's loop and graph runner drive (see the module doc).

    ``fields`` / ``state`` / ``step`` as a :class:`~cpattn.graphs.DecodeRunner`
    takes them; :meth:`batch` plans a step on the host; :meth:`commit` records
    what the step kept. ``device``: where the plan buffers live.
    """

    def __init__(self, forward: Callable[..., Any], cfg: Any, group: Group, params: dict, holder: V4DecodeCache, *,
                 hidden_layers: tuple | None = None):
        c = holder.cache
        if (group.rank, group.size) != (c.dcp_rank, c.dcp_size):
            raise ValueError(f"the cache is DCP rank {c.dcp_rank} of {c.dcp_size} but the group is rank {group.rank} "
                             f"of {group.size}; build the cache with the group")
        self.holder = holder
        self.fields = {"tokens": Field("token", (), torch.int64, pad=0), **plan_fields(c.layout, dcp_size=c.dcp_size)}
        self.state = {"params": params, "cache": cache_state(c)}
        self.step = functools.partial(v4_decode_step, forward=forward, cfg=cfg, layout=c.layout, group=group,
                                      interleave_size=c.interleave_size, hidden_layers=hidden_layers)
        self.device = c.tables["window"].device
        self._last: tuple[list[int], list[int], int] | None = None

    def batch(self, requests: list[int], context_lens: list[int], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's inputs: ``tokens`` [A * q] (request-major) after ``context_lens`` cached tokens of
        ``requests`` (cache rows), and the host plan."""
        q = tokens.numel() // max(len(requests), 1)
        self._last = (list(requests), list(context_lens), q)
        return {"tokens": tokens, **decode_plan(self.holder.cache, requests, context_lens, q)}

    def commit(self, requests: list[int], seq_lens: list[int]) -> None:
        """After the step planned by :meth:`batch`: request ``requests[i]`` keeps ``seq_lens[i]`` tokens; the
        rest of what the step wrote (rejected drafts) is rewound and poisoned."""
        reqs, ctx, q = self._last
        if list(requests) != reqs:
            raise ValueError(f"commit for requests {list(requests)} after a step planned for {reqs}")
        c = self.holder.cache
        lens, high, back = list(c.seq_lens), list(c.high_water), [0] * c.batch
        for b, l0, keep in zip(reqs, ctx, seq_lens):
            lens[b] = l0 + q
            high[b] = max(high[b], lens[b])
            back[b] = lens[b] - int(keep)
        self.holder.cache = replace(c, seq_lens=tuple(lens), high_water=tuple(high)).rewind(back)


@dataclass(frozen=True)
class V4Stages:
    """DeepSeek-V4's engine stages (the family's ``stages``); ``forward`` is the model's."""

    forward: Callable[..., Any]

    def prefill(self, group: Group, params: dict, cfg: Any, prompts: Prompts, *, algorithms: Algorithms = Algorithms(),
                prompt_logits: bool = False, prefix=None, hidden_layers: tuple | None = None) -> V4PrefillOut:
        """The prefill stage over ``group`` (:func:`cpattn.v4.prefill.v4_prefill`); no cached prefix."""
        if prefix is not None:
            raise ValueError("a cached prefix (prefix caching, a KV pool) is not supported for DeepSeek-V4: its "
                             "compressor state and entries are not per-token KV rows; prefill the whole prompt")
        return v4_prefill(group, self.forward, params, cfg, prompts, prompt_logits=prompt_logits,
                          hidden_layers=hidden_layers)

    def new_cache(self, cfg: Any, params: dict, prompts: Prompts, steps: int, decode_cfg: EngineConfig,
                  num_speculative_tokens: int, group: Group) -> V4DecodeCache:
        """An empty decode cache for this DCP rank: prompts plus ``steps`` tokens plus k drafts, rewindable by k."""
        k = int(num_speculative_tokens)
        dtype = param_dtype(params)
        lay = cfg.layout(max_rewind=k, block_size=decode_cfg.cache.block_size)
        cache = V4Cache.empty(lay, batch=prompts.num_requests, max_len=max(prompts.prompt_lens) + steps + k,
                              dtype=dtype, dcp_rank=group.rank, dcp_size=group.size,
                              interleave_size=decode_cfg.cache.cp_kv_cache_interleave_size)
        return V4DecodeCache(cache)

    def collect(self, group: Group, out: V4PrefillOut) -> V4Handoff:
        """What the decode caches need, on every rank of the prefill group (:func:`cpattn.v4.handoff.collect`)."""
        return collect(group, out)

    def place(self, holder: V4DecodeCache, handoff: V4Handoff) -> None:
        """Seed this decode rank's cache (rings whole, its own entries)."""
        holder.cache = seed_cache(holder.cache, handoff)

    def handoff(self, prefill_group: Group, holder: V4DecodeCache, out: V4PrefillOut) -> HandoffFacts:
        """Engines on the same ranks: collect over the prefill group, then seed this rank's cache."""
        before = prefill_group.stats.total_sent()
        h = collect(prefill_group, out)
        self.place(holder, h)
        sent = prefill_group.stats.total_sent() - before
        return HandoffFacts(rows_kept=int(h.tail.requests.numel()), bytes_sent=sent)

    def send(self, prefill_group: Group, out: V4PrefillOut, decode_ranks: list[int],
             world: Group | None = None) -> HandoffFacts:
        """P/D, on every prefill rank: collect over the prefill group; rank 0 sends the hand-off and the
        first-token logits to every decode rank (ranks ``decode_ranks`` of ``world``, default
        torch.distributed's world)."""
        h = collect(prefill_group, out)
        if prefill_group.rank != 0:
            return HandoffFacts()
        return HandoffFacts(bytes_sent=send_handoff(h, out.first_logits, decode_ranks, world))

    def recv(self, holder: V4DecodeCache, prompts: Prompts, src: int,
             world: Group | None = None) -> tuple[torch.Tensor, HandoffFacts]:
        """P/D, on every decode rank: receive ``prompts``' hand-off from rank ``src`` of ``world`` (default
        torch.distributed's world) and seed this rank's cache. Returns the first-token logits [B, V] and
        what arrived."""
        c = holder.cache
        h, first, got = recv_handoff(c.layout, prompts.prompt_lens, c.window[0].dtype, src, world)
        self.place(holder, h)
        return first, HandoffFacts(bytes_received=got)

    def decode_program(self, group: Group, params: dict, cfg: Any, holder: V4DecodeCache, *, merge: str = ENGINE_MERGE,
                       hidden_layers: tuple | None = None) -> V4DecodeProgram:
        """The decode program over this rank's cache (``merge`` is unused: V4 merges with one all-gather)."""
        return V4DecodeProgram(self.forward, cfg, group, params, holder, hidden_layers=hidden_layers)
