"""The decode stage: greedy steps over a DCP-sharded paged cache, plain or speculative, eager or captured.

Each step, for every active request with last token ``x`` (not yet in the
KV cache) and drafts ``d_1..d_k`` from a drafter (:mod:`cpattn.engine.drafters`;
k = 0 is plain decode)::

    query rows      x     d_1    d_2   ...  d_k        positions S .. S+k
    target argmax   g_0   g_1    g_2   ...  g_k        (one DCP step of 1 + k rows per request)
    accept a = number of leading j with d_{j+1} == g_j
    emit            g_0 .. g_a        (= d_1 .. d_a, then the bonus token g_a)
    cache           S -> S + 1 + a    (the KV of d_{a+1} .. d_k was written past
                                       seq_len: never read, overwritten next step)

A drafter that reads the target's hidden states (``drafter.hidden_layers``)
gets them with its next proposal: after prefill the prompt's rows, after
each step the 1 + k verified rows (the leading ``1 + a`` final), as a
:class:`~cpattn.engine.drafters.TargetHidden`; the step then also returns
those hidden states (the same function, eager or captured).

Query row j at position p sees exactly the local keys with index
``< local_len(p + 1, r)`` on rank r (DESIGN.md §4.3), so every row's logits
equal those of plain one-token decode at that position: the emitted tokens
are plain greedy generation's, for any k and any drafter.

The step (:func:`decode_step`) plans its DCP metadata on the device from
persistent ``seq_lens`` / ``block_table`` buffers, so the same function runs
eagerly or replayed from a :class:`cpattn.graphs.DecodeRunner` capture
(FULL_DECODE_ONLY: every verification batch is uniform, 1 + k rows per
request; capture sizes are multiples of 1 + k).

Example
-------
>>> import torch, cpattn
>>> from cpattn.models.family import get_family
>>> from cpattn.engine.paged_cache import PagedShard
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> fam, params = get_family("qwen3"), qwen3.init_params(cfg)
>>> def rank(g):  # an empty cache and one-token prompts: decode 3 tokens
...     shard = PagedShard.empty(fam.kv_layouts(cfg), capacity=[8], dcp_size=g.size, block_size=4, interleave_size=1)
...     return decode(g, fam, params, cfg, shard, [[]], torch.tensor([5]), 3).tokens.shape
>>> cpattn.simulate(2, rank)[0]
torch.Size([1, 3])
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.dcp import DCPMeta, plan_tensors
from cpattn.engine.drafters import TargetHidden
from cpattn.models.family import ModelFamily
from cpattn.engine.logits import forward_logits
from cpattn.engine.paged_cache import DCPStep, PagedShard
from cpattn.graphs.runner import DecodeRunner, Field
from cpattn.dcp.layer_merges import ENGINE_MERGE


@dataclass
class SpecStats:
    """Counts of one decode run (the same on every rank).

    steps: DCP decode (verification) steps; rows: (request, step) pairs;
    drafted / accepted: draft tokens proposed / accepted; emitted: tokens
    produced by the steps (accepted + one bonus per row, before cutting to
    the requested length); graph_steps: steps replayed from a capture;
    accepted_hist[a]: rows that accepted a drafts; draft_digest: a hash of
    every draft proposed, in order (equal on every rank when the replicated
    drafters agree).
    """

    steps: int = 0
    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    graph_steps: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    draft_digest: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gains per step: emitted / rows (1 without speculation, at most 1 + k); the mean
        acceptance length (accepted drafts + the bonus token)."""
        return self.emitted / self.rows if self.rows else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of rows whose draft j (1-based, j = 1..k) was accepted (so were drafts 1..j-1).

        >>> SpecStats(rows=4, accepted_hist=[1, 2, 1]).acceptance_per_position
        [0.75, 0.25]
        """
        if not self.rows:
            return [0.0] * max(len(self.accepted_hist) - 1, 0)
        return [sum(self.accepted_hist[j:]) / self.rows for j in range(1, len(self.accepted_hist))]

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "drafted": self.drafted, "accepted": self.accepted,
                "emitted": self.emitted, "graph_steps": self.graph_steps,
                "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step,
                "acceptance_per_position": self.acceptance_per_position,
                "accepted_hist": list(self.accepted_hist), "draft_digest": self.draft_digest}


@dataclass(frozen=True)
class DecodeOut:
    """tokens [B, steps] int64; logits [B, steps, V] float32, float64 in a float64 run (the row each token
    was chosen from); stats; step_s: wall seconds of each step on this rank; runner: the runner's stats (graph mode) or None."""

    tokens: torch.Tensor
    logits: torch.Tensor
    stats: SpecStats
    step_s: list[float]
    runner: dict | None = None


def accept_drafts(drafts: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Accepted draft count per request: the longest prefix with ``drafts[:, j] == greedy[:, j]``.

    drafts: [A, k]; greedy: [A, 1 + k] (the target's argmax at each query row).
    Returns [A] int64 in 0..k; request i then emits ``greedy[i, :a_i + 1]``.

    Example
    -------
    >>> accept_drafts(torch.tensor([[4, 5, 6], [4, 0, 6]]), torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7]])).tolist()
    [3, 1]
    """
    k = drafts.shape[1]
    same = (drafts == greedy[:, :k]).long()  # [A, k]
    return same.cumprod(dim=1).sum(dim=1)  # [A]


def cache_capacity(prompt_lens: list[int], steps: int, num_speculative_tokens: int) -> list[int]:
    """Tokens each request's cache must hold: prompt + steps + k (a last step writes k rows past the end)."""
    return [m + steps + num_speculative_tokens for m in prompt_lens]


def step_fields(max_blocks: int) -> dict[str, Field]:
    """DecodeRunner inputs of :func:`decode_step`: tokens [T] (pad 0), seq_lens [B] (pad 0: sees no key),
    block_table [B, max_blocks] (pad block 0, never read)."""
    return {"tokens": Field("token", (), torch.int64, pad=0), "seq_lens": Field("request", (), torch.int64, pad=0),
            "block_table": Field("request", (max_blocks,), torch.int64, pad=0)}


def batch_step(group: Group, shard: PagedShard, batch: dict[str, torch.Tensor], merge: str) -> DCPStep:
    """The :class:`DCPStep` of one step's ``batch`` (:func:`step_fields` plus ``cu_seqlens_q`` [B+1]) over
    ``shard``: its DCP plan made on the device (capturable, no host sync)."""
    cu = batch["cu_seqlens_q"]
    ql = cu[1:] - cu[:-1]  # [B]
    tensors = plan_tensors(batch["seq_lens"], ql, batch["block_table"], num_tokens=batch["tokens"].shape[0],
                           dcp_size=group.size, interleave_size=shard.interleave_size, block_size=shard.block_size)
    meta = DCPMeta(dcp_size=group.size, interleave_size=shard.interleave_size, block_size=shard.block_size,
                   block_table=batch["block_table"], seq_lens=batch["seq_lens"], query_lens=ql, **tensors)
    return DCPStep(group, shard, meta, merge)


def decode_step(state: dict, batch: dict[str, torch.Tensor], *, family: ModelFamily, cfg: Any, group: Group,
                merge: str, hidden_layers: tuple | None = None):
    """One decode / verification step of the whole model, capturable (no host sync in cpattn's part).

    state: ``{"params": ..., "shard": PagedShard}`` (the shard is written in
    place); batch: see :func:`step_fields` plus ``cu_seqlens_q`` [B+1].
    Padding rows (no request) write no KV (slot -1) and see no key.
    Returns (logits [T, V] float32 (float64 in a float64 run), argmax [T] int64), plus the requested
    hidden states ``{name: [T, H]}`` as a third output with ``hidden_layers``.
    """
    step = batch_step(group, state["shard"], batch, merge)
    return forward_logits(family.forward, state["params"], cfg, batch["tokens"], step, hidden_layers=hidden_layers)


def make_runner(group: Group, family: ModelFamily, params: dict, cfg: Any, shard: PagedShard, *,
                num_speculative_tokens: int, max_requests: int, merge: str = ENGINE_MERGE,
                capture_sizes: list[int] | None = None, backend: str = "eager",
                hidden_layers: tuple | None = None) -> DecodeRunner:
    """A captured :class:`~cpattn.graphs.DecodeRunner` for steps of 1 + k tokens per request.

    capture_sizes: multiples of 1 + k (validated); default
    ``capture_sizes(max_requests * (1 + k), k)``. A compiler backend needs a
    family whose decode step is capturable (``family.capturable``).
    """
    if backend != "eager" and not family.capturable:
        raise ValueError(
            f"graph backend {backend!r}: the {family.name} decode step has data-dependent shapes or host syncs "
            "(it is not capturable); use the 'eager' backend (persistent buffers and padding, no compiler)")
    q_len = 1 + num_speculative_tokens
    prog = family.backend.program(group, family, params, cfg, shard, merge=merge, hidden_layers=hidden_layers)
    runner = DecodeRunner(prog.step, prog.state, prog.fields, num_speculative_tokens=num_speculative_tokens,
                          capture_sizes=capture_sizes, max_size=max(q_len, max_requests * q_len), backend=backend,
                          device=prog.device)
    return runner.capture()


def decode(group: Group, family: ModelFamily, params: dict, cfg: Any, shard: PagedShard, prompts: list[list[int]],
           first: torch.Tensor, steps: int, *, drafter=None, num_speculative_tokens: int = 0, merge: str = ENGINE_MERGE,
           runner: DecodeRunner | None = None, on_step=None, prompt_hidden: TargetHidden | None = None,
           draft_graph: str | None = None) -> DecodeOut:
    """``steps`` more greedy tokens per request from a filled DCP shard; run it on every rank of the DCP group.

    shard: this rank's cache holding every prompt's KV (capacity
    :func:`cache_capacity`); prompts: B token lists (the drafter's history);
    first: [B] the token after each prompt (not yet in the cache).
    drafter: a drafter (:mod:`cpattn.engine.drafters`) with k =
    ``num_speculative_tokens`` >= 1, or None for plain decode. runner: a
    :func:`make_runner` runner for the same shard and k (graph mode), or None
    (eager); built with the drafter's ``hidden_layers`` when it reads them.
    on_step: called after each step (progress). prompt_hidden: the
    prompts' hidden states from the prefill (``drafter.hidden_layers``),
    for a drafter that reads them. draft_graph: graph backend of the
    drafter's own steps (None: eager). Returns a :class:`DecodeOut`, the
    same tokens on every rank.
    """
    k = int(num_speculative_tokens) if drafter is not None else 0
    layers = drafter.hidden_layers if k else None
    if layers is not None and prompt_hidden is None:
        raise ValueError(f"the {drafter.method} drafter reads the target's hidden states: pass prompt_hidden (the "
                         f"prefill's hidden_layers={tuple(layers)}) to decode")
    b = len(prompts)
    lens = [len(p) for p in prompts]  # tokens in the cache
    hist = [list(map(int, p)) + [int(f)] for p, f in zip(prompts, first.tolist())]
    out_tok: list[list[int]] = [[] for _ in range(b)]
    out_log: list[list[torch.Tensor]] = [[] for _ in range(b)]
    stats = SpecStats(accepted_hist=[0] * (k + 1))
    draft = drafter.start(b, max(lens) + steps + k + 1, graph=draft_graph) if k else None
    # the cache backend's program plans each step and commits what verification kept
    program = family.backend.program(group, family, params, cfg, shard, merge=merge, hidden_layers=layers)
    eager, state = program.step, program.state
    step_s = []
    pending, pending_reqs = prompt_hidden, list(range(b))  # target hidden rows not yet given to the drafter
    while True:
        active = [i for i in range(b) if len(out_tok[i]) < steps]
        if not active:
            break
        t0 = time.perf_counter()
        hidden = None
        if layers is not None:
            hidden = pending.take([pending_reqs.index(i) for i in active])
        drafts = draft.propose([hist[i] for i in active], k, active, hidden) if k else \
            torch.zeros(len(active), 0, dtype=torch.int64)
        last = torch.tensor([hist[i][-1] for i in active], dtype=torch.int64)
        tokens = torch.cat([last[:, None], drafts], 1).flatten()  # [A * (1 + k)]
        batch = program.batch(active, [lens[i] for i in active], tokens)  # paged: seq_lens [A], block_table [A, M]
        if runner is not None:
            out = runner(batch, [1 + k] * len(active))  # [A * (1 + k), V], [A * (1 + k)](, hidden)
            stats.graph_steps += runner.stats.last.startswith("graph")
        else:
            cu = torch.arange(0, (len(active) + 1) * (1 + k), 1 + k, dtype=torch.int32)
            out = eager(state, {**batch, "cu_seqlens_q": cu})
        logits, greedy = out[0], out[1]
        logits = logits.view(len(active), 1 + k, -1)  # [A, 1 + k, V]
        greedy = greedy.view(len(active), 1 + k)  # [A, 1 + k]
        acc = accept_drafts(drafts, greedy).tolist()
        if layers is not None:  # the verified rows' hidden states, for the next proposal
            pending = TargetHidden({n: h.view(len(active), 1 + k, -1) for n, h in out[2].items()},
                                   tuple(lens[i] for i in active), tuple(1 + a for a in acc))
            pending_reqs = list(active)
        if k:
            stats.draft_digest = hash((stats.draft_digest, tuple(drafts.flatten().tolist())))
        for j, i in enumerate(active):
            a = acc[j]
            new = greedy[j, : a + 1].tolist()
            hist[i].extend(new)
            lens[i] += 1 + a  # the last token and the accepted drafts; rejected rows lie past seq_len
            out_tok[i].extend(new)
            out_log[i].extend(logits[j, : a + 1])
            stats.accepted_hist[a] += 1
        program.commit(active, [lens[i] for i in active])
        if k:
            draft.rollback(active, [len(hist[i]) - 1 for i in active])  # what the target's cache now holds
        stats.steps += 1
        stats.rows += len(active)
        stats.drafted += k * len(active)
        stats.accepted += sum(acc)
        stats.emitted += sum(acc) + len(active)
        step_s.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(stats.steps)
    if steps == 0:
        return DecodeOut(torch.zeros(b, 0, dtype=torch.int64), torch.zeros(b, 0, 0), stats, step_s,
                         runner.stats.as_dict() if runner is not None else None)
    toks = torch.tensor([t[:steps] for t in out_tok], dtype=torch.int64)  # [B, steps]
    logs = torch.stack([torch.stack(lg[:steps]) for lg in out_log])  # [B, steps, V]
    return DecodeOut(toks, logs, stats, step_s, runner.stats.as_dict() if runner is not None else None)
