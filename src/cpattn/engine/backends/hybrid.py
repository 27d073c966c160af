"""The hybrid cache backend: paged KV for the full-attention layers, a recurrent state per request for the linear ones.

A hybrid family (``ModelFamily(cache="hybrid", recurrent_cache=...)``:
Qwen3-Next / Qwen3.5, DESIGN.md §4.13) has two kinds of token mixer. The
backend gives each what it needs, behind the
:class:`~cpattn.engine.backend.CacheBackend` seam:

- **full-attention layers**: per-token KV rows (``family.kv_layouts(cfg)``,
  one entry per such layer) in the engine's DCP-sharded
  :class:`~cpattn.engine.paged_cache.PagedShard`, exactly as the paged kind:
  head-tail PCP prefill (:class:`~cpattn.engine.prefill_steps.PCPStep`, ring
  or all-gather), rows or whole blocks handed off, DCP decode;
- **linear-attention layers**: a conv state [B, K-1, C] and a recurrent state
  [B, Hv, Dk, Dv] per request and layer (a
  :class:`~cpattn.linear.state.RecurrentCache`). Under PCP the layers see the
  attention layers' head-tail tokens as two sequence-order parts and scan
  the chunk summaries (:class:`~cpattn.linear.pcp_step.PCPLinearStep`: one
  all-gather of summaries and conv tails per layer); every prefill rank ends
  with every request's states. One prefill rank runs the plain chunked op in
  request order.

**What DCP means for a state that does not grow.** DCP shards what grows with
the context, the attention layers' KV (rank r keeps token t iff ``(t // I) %
N == r``). A linear layer's state is a fixed ``Hv * Dk * Dv`` floats per
request whatever the context, so there is nothing to shard along the
sequence: each DCP rank holds **every request's states, replicated**, and
updates them identically (the model's hidden state is the same on every DCP
rank: the engine splits only the attention's query heads, and only inside
the attention). Splitting the state by value heads instead would need the
linear layers' projections split the same way (tensor parallelism of the
linear layers), which cpattn does not do; keeping it on one owner would add a
broadcast of each linear layer's output every step. Replicated costs
``state_bytes`` on every rank (:meth:`HybridCache.state_bytes`, counted in
``kv_bytes`` beside the sharded attention KV) and no communication.

Hand-offs carry the states with the KV: on the same ranks every decode rank
takes them from its own prefill result (the same on every prefill rank);
across P/D prefill rank 0 sends them point to point after the blocks.

Speculative decoding (any drafter; those reading hidden states get them from
the prefill and every step): each decode step carries 1 + k tokens per
request, the linear layers keep the state after every position in per-position
buffers (``HybridCache.pending``) and :meth:`HybridProgram.commit` keeps the
one after the last accepted token.

What the kind refuses, each in one line: a cached prefix (prefix caching) and
the KV pool (their whole blocks carry no state snapshot at block boundaries),
and compiler graph backends (the decode step
gathers the active requests' states by index; the "eager" runner with
persistent buffers and padding works). The step loop
(:class:`~cpattn.engine.llm.LLMEngine`) runs paged-cache families only.

Example
-------
>>> import torch, cpattn
>>> from cpattn.engine.batch import Prompts
>>> from cpattn.models.family import get_family
>>> from cpattn.models import qwen3_next as qn
>>> fam, cfg = get_family("qwen3_next"), qn.Qwen3NextConfig.tiny()
>>> params = qn.init_params(cfg, seed=0)
>>> def rank(g):
...     out = HYBRID.prefill(g, fam, params, cfg, Prompts.of([[1, 2, 3, 4, 5]]), prompt_logits=False)
...     return out.first_logits.argmax(-1).tolist(), out.states.state[0].shape
>>> one, two = cpattn.simulate(1, rank)[0], cpattn.simulate(2, rank)[0]
>>> one == two, one[1]
(True, torch.Size([1, 3, 8, 12]))
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.engine.backends.paged import PAGED, Rows, handoff as paged_handoff
from cpattn.engine.decode import batch_step, step_fields
from cpattn.engine.handoff import HandoffFacts
from cpattn.engine.kv_rows import pack_rows
from cpattn.engine.logits import as_logits, forward_logits
from cpattn.engine.options import Algorithms
from cpattn.engine.paged_cache import PagedShard
from cpattn.engine.prefill import PrefillOut, gather_unshard
from cpattn.engine.prefill_steps import PCPStep
from cpattn.graphs.runner import Field
from cpattn.layout.pcp import pcp_plan, pcp_shard
from cpattn.linear.layout import ScanLayout
from cpattn.linear.pcp_step import PCPLinearStep
from cpattn.linear.state import RecurrentCache
from cpattn.models.family import param_dtype
from cpattn.engine.backends.hybrid_states import SlotStates, commit_positions, pending_states
from cpattn.dcp.layer_merges import ENGINE_MERGE


def _refuse(family, what: str, why: str, fix: str) -> None:
    raise ValueError(f"{what} for {family.name}: {why} (ModelFamily.cache='hybrid'); {fix}")


@dataclass(frozen=True)
class HybridPrefillOut(PrefillOut):
    """A :class:`~cpattn.engine.prefill.PrefillOut` (the attention layers' rows) plus ``states``: every
    request's linear-layer states after its prompt, the same on every prefill rank."""

    states: RecurrentCache | None = None


@dataclass(frozen=True)
class HybridCache:
    """One decode rank's cache: ``shard`` (the full-attention layers' KV, DCP-sharded) and ``states`` (every
    request's linear-layer states, replicated on every DCP rank; updated in place by the decode step)."""

    shard: PagedShard
    states: RecurrentCache
    pending: tuple | None = None  # with drafts: the states after each of 1 + k positions (pending_states)
    width: int = 1  # tokens per request of a decode step: 1 + k

    @property
    def block_table(self) -> torch.Tensor:
        return self.shard.block_table

    def attention_kv_bytes(self) -> int:
        """Bytes of this rank's attention KV (its DCP share: grows with the context)."""
        return self.shard.kv_bytes()

    def state_bytes(self) -> int:
        """Bytes of the linear layers' states on this rank (every request's: fixed, whatever the context)."""
        return self.states.state_bytes()

    def pending_bytes(self) -> int:
        """Bytes of the per-draft-position state buffers (0 without drafts): 1 + k states per request."""
        if self.pending is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (*self.pending[0], *self.pending[1]))

    def kv_bytes(self) -> int:
        """Both kinds: this rank's attention KV share plus the replicated states (and, with drafts, their
        per-position buffers)."""
        return self.attention_kv_bytes() + self.state_bytes() + self.pending_bytes()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The state tensors in a fixed order (conv of every linear layer, then recurrent)."""
        return (*self.states.conv, *self.states.state)

    def set_states(self, states: RecurrentCache) -> None:
        """Copy ``states`` (every request's, in request order) into this cache's tensors, in place."""
        for dst, src in zip(self.tensors(), (*states.conv, *states.state)):
            dst.copy_(src)


class _RequestOrder:
    """The one-device linear step of a head-tail plan's local tokens: the plain chunked op in request order
    (``restore_index`` in, ``token_index`` back out)."""

    def __init__(self, step, plan):
        self.step, self.to_req, self.back = step, plan.restore_index, plan.token_index[0]

    def conv(self, layer, x, weight, bias=None):
        return self.step.conv(layer, x[self.to_req], weight, bias)[self.back]

    def delta(self, layer, q, k, v, g, beta, scale):
        r = self.to_req
        return self.step.delta(layer, q[r], k[r], v[r], g[r], beta[r], scale)[self.back]

    def finish(self) -> RecurrentCache:
        return self.step.finish()


def hybrid_prefill(group: Group, family, params: dict, cfg: Any, prompts, *, algorithms: Algorithms = Algorithms(),
                   prompt_logits: bool = False, prefix=None, hidden_layers=None,
                   states: RecurrentCache | None = None) -> HybridPrefillOut:
    """Prefill ``prompts`` split head-tail over ``group`` (run on every rank): the attention layers by PCP,
    the linear layers by the scan over the same local tokens. Returns a :class:`HybridPrefillOut`.

    A chunk continuing its requests (the step loop's PCP chunks): ``prefix`` (the cached KV rows of each
    request's first ``prefix.context_lens[b]`` tokens, as the paged prefill takes it) together with
    ``states``, every request's linear-layer states after those tokens (zeros where the context is 0);
    only the new tokens are computed. A prefix without states is refused (cached blocks carry no states).
    hidden_layers: also return the hidden states a drafter reads (``{name: [T, H]}`` of the new tokens, request
    order, gathered over the group), as the paged prefill does."""
    if prefix is not None and states is None:
        _refuse(family, "a cached prefix (prefix caching)", "the cached whole blocks carry KV rows but no "
                "snapshot of the linear layers' states at block boundaries", "run without a prefix")
    layouts = family.kv_layouts(cfg)
    ctx = None if prefix is None else prefix.context_lens
    prompts = prompts if prefix is None else prompts.suffix(ctx)  # the new tokens
    cu = prompts.cu_seqlens
    plan = pcp_plan(cu, group.size, context_lens=ctx)
    attn = PCPStep(group, plan, layouts, method=algorithms.pcp_method, prefix=prefix)
    mine = pcp_shard(prompts.tokens, plan, group.rank)  # [T_r]
    emb = params["model.embed_tokens.weight"]
    if states is None:
        states = family.recurrent_cache(cfg, batch=prompts.num_requests, dtype=param_dtype(params),
                                        device=emb.device)
    if group.size == 1:
        lin = _RequestOrder(states.step(list(prompts.prompt_lens)), plan)
    else:
        r = group.rank
        lin = PCPLinearStep(group, ScanLayout.head_tail(group.size), [plan.cu_a[r], plan.cu_b[r]], states)
    before = group.stats.total_sent()
    idx = plan.token_index[group.rank]
    last = torch.tensor(cu[1:]) - 1  # [B] each request's last prompt token
    rows_end, reqs = (idx[:, None] == last[None, :]).nonzero(as_tuple=True)
    extra = {} if hidden_layers is None else {"hidden_layers": tuple(hidden_layers)}
    out = family.forward(params, cfg, mine, attn, lin, logits_index=None if prompt_logits else rows_end, **extra)
    logits, hidden = out if hidden_layers is not None else (out, None)
    logits = as_logits(logits)
    full = None
    if prompt_logits:
        full = gather_unshard(group, logits, plan)  # [T, V] request order
        first = full[last]
    else:
        first = torch.zeros(prompts.num_requests, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        first = group.all_reduce(first.index_copy(0, reqs, logits))
    if hidden is not None:
        hidden = {name: gather_unshard(group, h, plan) for name, h in hidden.items()}  # [T, H] request order
    kv = [attn.kv[j] for j in range(len(layouts))]
    rows = pack_rows(layouts, [x.k for x in kv], [x.v for x in kv], [x.k_index for x in kv])  # [T_r, F]
    return HybridPrefillOut(plan, rows, first, full, hidden, group.stats.total_sent() - before, states=lin.finish())


def hybrid_decode_step(state: dict, batch: dict[str, torch.Tensor], *, family, cfg: Any, group: Group, merge: str,
                       width: int = 1, hidden_layers: tuple | None = None):
    """One decode step of ``width`` = 1 + k tokens per request row (the last token and k drafts): DCP attention
    over ``state["shard"]`` and the linear layers' recurrent op on ``state["states"]`` rows ``batch["requests"]``
    (both updated in place; with drafts the states after each position go to ``state["pending"]`` instead, the
    slot untouched until :meth:`HybridProgram.commit`). Returns (logits [T, V], argmax [T]), plus the hidden
    states ``{name: [T, H]}`` with ``hidden_layers``."""
    cu = batch["cu_seqlens_q"]
    tokens, rows = batch["tokens"], batch["requests"]
    if tokens.shape[0] != rows.shape[0] * width:
        raise ValueError(f"batch: {tokens.shape[0]} tokens for {rows.shape[0]} request rows; this hybrid decode "
                         f"step takes {width} (1 + k) tokens per request")
    attn = batch_step(group, state["shard"], batch, merge)
    start = torch.zeros_like(rows, dtype=torch.bool)
    if width == 1:
        lin = SlotStates(state["states"], rows, start, None, decode=True)
    else:  # every row verifies its drafts position by position (padding rows: slot -1, no token of theirs)
        lin = SlotStates(state["states"], rows, start, cu, decode=False, pending=state["pending"], only=True,
                         verify=(torch.arange(rows.shape[0], device=rows.device), width))
    return forward_logits(family.forward, state["params"], cfg, tokens, attn, lin, hidden_layers=hidden_layers)


class HybridProgram:
    """The hybrid decode program: :func:`hybrid_decode_step` over a :class:`HybridCache`; inputs ``tokens``,
    ``seq_lens``, ``block_table`` (as the paged program) and ``requests`` (each row's request, pad -1).

    With drafts (a cache built with ``num_speculative_tokens`` = k: ``cache.pending``) every step carries
    1 + k tokens per request and leaves the linear states after each position in ``cache.pending``;
    :meth:`commit` then keeps, per request, the state after its last accepted token (the attention layers'
    rejected rows lie past ``seq_lens``, as in the paged program)."""

    def __init__(self, family, cfg: Any, group: Group, params: dict, cache: HybridCache, *, merge: str = ENGINE_MERGE,
                 hidden_layers: tuple | None = None):
        self.cache = cache
        self.width = cache.width
        self.step = functools.partial(hybrid_decode_step, family=family, cfg=cfg, group=group, merge=merge,
                                      width=self.width, hidden_layers=hidden_layers)
        self.state = {"params": params, "shard": cache.shard, "states": cache.states}
        if cache.pending is not None:
            self.state["pending"] = cache.pending
        self.fields = {**step_fields(cache.block_table.shape[1]),
                       "requests": Field("request", (), torch.int64, pad=-1)}
        self.device = cache.block_table.device
        self._context: dict[int, int] = {}  # each request's cached tokens before the step in flight

    def batch(self, requests: list[int], context_lens: list[int], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """1 + k tokens per request (the last one, then its drafts) after ``context_lens`` cached tokens:
        seq_lens, block_table, requests."""
        if tokens.numel() != len(requests) * self.width:
            raise ValueError(f"tokens: {tokens.numel()} for {len(requests)} requests; this hybrid decode program "
                             f"takes {self.width} per request (1 + k, the k its cache was built for)")
        self._context = dict(zip(requests, context_lens))
        return {"tokens": tokens, "seq_lens": torch.tensor([c + self.width for c in context_lens]),
                "block_table": self.cache.block_table[list(requests)], "requests": torch.tensor(list(requests))}

    def commit(self, requests: list[int], seq_lens: list[int]) -> None:
        """After verification (``seq_lens``: each request's kept tokens): the state after its last accepted
        token becomes its state (nothing to do without drafts: every step kept)."""
        if self.cache.pending is None:
            return
        acc = [s - self._context[r] - 1 for r, s in zip(requests, seq_lens)]  # accepted drafts, 0 .. k
        commit_positions(self.cache.states, self.cache.pending, torch.tensor(list(requests)), torch.tensor(acc))


class HybridBackend:
    """The ``"hybrid"`` cache kind (module doc)."""

    name = "hybrid"
    per_token_kv = False

    def check_run(self, family, *, drafter=None) -> None:
        """What the driver asks before any rank starts: nothing is refused (drafts are verified with the states
        after every draft position: :class:`HybridProgram`)."""

    def prefill(self, group: Group, family, params: dict, cfg: Any, prompts, *, algorithms: Algorithms = Algorithms(),
                prompt_logits: bool = False, prefix=None, hidden_layers=None) -> HybridPrefillOut:
        return hybrid_prefill(group, family, params, cfg, prompts, algorithms=algorithms,
                              prompt_logits=prompt_logits, prefix=prefix, hidden_layers=hidden_layers)

    def new_cache(self, family, cfg: Any, params: dict, prompts, steps: int, decode_cfg, num_speculative_tokens: int,
                  group: Group | None = None) -> HybridCache:
        k = num_speculative_tokens
        shard = PAGED.new_cache(family, cfg, params, prompts, steps, decode_cfg, k, group)
        dev = params["model.embed_tokens.weight"].device
        states = family.recurrent_cache(cfg, batch=prompts.num_requests, dtype=param_dtype(params), device=dev)
        return HybridCache(shard, states, pending_states(states, 1 + k) if k else None, 1 + k)

    def collect(self, prefill_group: Group, out: HybridPrefillOut) -> tuple[Rows, RecurrentCache]:
        return PAGED.collect(prefill_group, out), out.states

    def place(self, cache: HybridCache, collected: tuple[Rows, RecurrentCache], decode_group: Group) -> None:
        rows, states = collected
        PAGED.place(cache.shard, rows, decode_group)
        cache.set_states(states)

    def handoff(self, world: Group, prefill_group: Group, decode_group: Group, cache: HybridCache,
                out: HybridPrefillOut, algorithms: Algorithms = Algorithms(), prefix=None) -> HandoffFacts:
        """The rows as the paged kind moves them; the states from this rank's own prefill result (every prefill
        rank holds them all), so they cost no communication."""
        if prefix is not None:
            raise ValueError("prefix: a cached prefix for a hybrid model (ModelFamily.cache='hybrid'): its whole "
                             "blocks carry no snapshot of the linear layers' states; run without a prefix")
        facts = paged_handoff(world, prefill_group, decode_group, cache.shard, out, algorithms)
        cache.set_states(out.states)
        return facts

    def send(self, world: Group, prefill_group: Group, out: HybridPrefillOut, decode_ranks: list[int],
             block_size: int) -> HandoffFacts:
        """The whole blocks as the paged kind sends them; then prefill rank 0 sends every request's states to
        every decode rank (conv then recurrent, per linear layer), counted in ``bytes_sent``."""
        facts = PAGED.send(world, prefill_group, out, decode_ranks, block_size)
        if prefill_group.rank != 0:
            return facts
        sent = 0
        for r in decode_ranks:
            for t in (*out.states.conv, *out.states.state):
                world.send(t.contiguous(), r)
                sent += t.numel() * t.element_size()
        return dataclasses.replace(facts, bytes_sent=facts.bytes_sent + sent)

    def recv(self, world: Group, cache: HybridCache, prompts, cfg: Any, *, prefill_ranks: list[int],
             decode_group: Group, dtype: torch.dtype, start: list[int] | None = None):
        first, facts = PAGED.recv(world, cache.shard, prompts, cfg, prefill_ranks=prefill_ranks,
                                  decode_group=decode_group, dtype=dtype, start=start)
        got = 0
        for t in cache.tensors():
            t.copy_(world.recv(tuple(t.shape), t.dtype, prefill_ranks[0]))
            got += t.numel() * t.element_size()
        return first, dataclasses.replace(facts, bytes_received=facts.bytes_received + got)

    def program(self, group: Group, family, params: dict, cfg: Any, cache: HybridCache, *, merge: str = ENGINE_MERGE,
                hidden_layers: tuple | None = None) -> HybridProgram:
        return HybridProgram(family, cfg, group, params, cache, merge=merge, hidden_layers=hidden_layers)


HYBRID = HybridBackend()
