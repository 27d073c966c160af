"""Speculative decoding with DCP: draft k tokens, verify 1 + k per request in one DCP decode step.

Each step, for every active request with last token ``x`` (not yet in the
KV cache) and drafts ``d_1..d_k`` (:mod:`cpattn.models.drafters`, greedy)::

    query rows      x     d_1    d_2   ...  d_k        positions S .. S+k
    target argmax   g_0   g_1    g_2   ...  g_k        (one DCP decode step, 1 + k queries)
    accept a = number of leading j with d_{j+1} == g_j
    emit            g_0 .. g_a        (= d_1 .. d_a, then the bonus token g_a)
    cache           S -> S + 1 + a    (x, d_1 .. d_a); the KV of d_{a+1} .. d_k was
                                      written but lies past seq_len: never read,
                                      overwritten by the next step's rows

The verification is one :func:`cpattn.dcp.dcp_decode` over multi-token
queries: row j at position p sees exactly the local keys with index
``< local_len(p + 1, r)`` on rank r (DESIGN.md §4.3), so every row's logits
equal those of plain one-token decode at that position, and the emitted
tokens are plain greedy generation's, for any k.

Graph mode (``graph=True``): every verification batch is uniform (1 + k rows
per request), so it runs through a :class:`cpattn.graphs.DecodeRunner` whose
capture sizes are multiples of 1 + k; the step plans its DCP metadata on the
device (:func:`cpattn.dcp.plan_tensors`). Under the simulated mesh the
runner's backend is "eager" (thread collectives cannot be traced): the
bucketing, padding and persistent buffers are exercised, not a compiler.

Example
-------
>>> import torch
>>> from cpattn.models import qwen3
>>> from cpattn.models.drafters import NgramDrafter
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> out = speculative_generate(qwen3, qwen3.init_params(cfg), cfg, [[1, 2, 3, 1, 2]], 6,
...                            drafter=NgramDrafter(), num_speculative_tokens=2, dcp_size=2)
>>> out.tokens.shape, out.stats.drafted > 0
(torch.Size([1, 6]), True)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.comm.sim import simulate
from cpattn.dcp import DCPMeta, dcp_plan, plan_tensors
from cpattn.graphs import buckets
from cpattn.graphs.runner import DecodeRunner, Field
from cpattn.models import resolve_model
from cpattn.models.dcp_cache import DCPStep, PagedShard, fill_from_prefill
from cpattn.models.generate import _packed, check_layout, prefill, prefill_local, prefill_on_rank, uses_dsa


@dataclass
class SpecStats:
    """Counts of one speculative generation (the same on every rank).

    steps: verification steps (DCP decode steps); rows: (request, step)
    pairs verified; drafted / accepted: draft tokens proposed / accepted;
    emitted: tokens produced by verification (accepted + one bonus per row,
    before cutting to ``max_new_tokens``); graph_steps: steps replayed from
    a captured program (the rest ran eagerly).
    """

    steps: int = 0
    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    graph_steps: int = 0
    accepted_hist: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gains per verification step: emitted / rows (1 without speculation, at most 1 + k)."""
        return self.emitted / self.rows if self.rows else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "drafted": self.drafted, "accepted": self.accepted,
                "emitted": self.emitted, "graph_steps": self.graph_steps,
                "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step,
                "accepted_hist": list(self.accepted_hist)}


@dataclass(frozen=True)
class SpecGeneration:
    """Result of :func:`speculative_generate`: tokens [B, N] int64, logits [B, N, V] float32
    (the verification row each token was chosen from), prompt_logits [T, V], stats."""

    tokens: torch.Tensor
    logits: torch.Tensor
    prompt_logits: torch.Tensor
    stats: SpecStats


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


def shard_capacity(prompt_lens: list[int], steps: int, num_speculative_tokens: int) -> list[int]:
    """Tokens each request's cache must hold: prompt + steps + k (a last step writes k rows past the end)."""
    return [m + steps + num_speculative_tokens for m in prompt_lens]


def verify_fields(max_blocks: int) -> dict[str, Field]:
    """DecodeRunner inputs of :func:`verify_step`: tokens [T] (pad 0), seq_lens [B] (pad 0: sees no key),
    block_table [B, max_blocks] (pad block 0, never read)."""
    return {"tokens": Field("token", (), torch.int64, pad=0), "seq_lens": Field("request", (), torch.int64, pad=0),
            "block_table": Field("request", (max_blocks,), torch.int64, pad=0)}


def verify_step(state: dict, batch: dict[str, torch.Tensor], *, model: ModuleType, cfg: Any, group: Group,
                merge: str) -> torch.Tensor:
    """One verification (or decode) step with metadata planned on the device: -> logits [T, V] float32.

    state: ``{"params": ..., "shard": PagedShard}`` (the shard is written in place);
    batch: see :func:`verify_fields` plus ``cu_seqlens_q`` [B+1]. Padding rows
    (no request) write no KV (slot -1) and see no key.
    """
    shard: PagedShard = state["shard"]
    cu = batch["cu_seqlens_q"]
    ql = cu[1:] - cu[:-1]  # [B]
    t = batch["tokens"].shape[0]
    tensors = plan_tensors(batch["seq_lens"], ql, batch["block_table"], num_tokens=t, dcp_size=group.size,
                           interleave_size=shard.interleave_size, block_size=shard.block_size)
    meta = DCPMeta(dcp_size=group.size, interleave_size=shard.interleave_size, block_size=shard.block_size,
                   block_table=batch["block_table"], seq_lens=batch["seq_lens"], query_lens=ql, **tensors)
    return model.forward(state["params"], cfg, batch["tokens"], DCPStep(group, shard, meta, merge)).float()


def make_verify_runner(group: Group, model: ModuleType | str, params: dict, cfg: Any, shard: PagedShard, *,
                       num_speculative_tokens: int, max_requests: int, merge: str = "ag_rs",
                       capture_sizes: list[int] | None = None, backend: str = "eager") -> DecodeRunner:
    """A captured :class:`~cpattn.graphs.DecodeRunner` for verification steps of 1 + k tokens per request.

    capture_sizes: multiples of 1 + k (validated); default
    ``buckets.capture_sizes(max_requests * (1 + k), k)``.
    """
    if backend != "eager" and uses_dsa(cfg):
        raise ValueError(
            f"backend {backend!r}: a DSA model's decode step gathers keys by data (top-k selection, host-side "
            "key lists), so it cannot be captured; use backend='eager' for DeepSeek-V3.2-style models"
        )
    q_len = 1 + num_speculative_tokens
    step = functools.partial(verify_step, model=resolve_model(model), cfg=cfg, group=group, merge=merge)
    runner = DecodeRunner(step, {"params": params, "shard": shard}, verify_fields(shard.block_table.shape[1]),
                          num_speculative_tokens=num_speculative_tokens, capture_sizes=capture_sizes,
                          max_size=max(q_len, max_requests * q_len), backend=backend,
                          device=shard.block_table.device)
    return runner.capture()


def spec_decode_loop(group: Group, model: ModuleType | str, params: dict, cfg: Any, shard: PagedShard,
                     prompts: list[list[int]], first: torch.Tensor, steps: int, *, drafter=None,
                     num_speculative_tokens: int = 0, merge: str = "ag_rs", graph: bool = False,
                     capture_sizes: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, SpecStats]:
    """``steps`` more greedy tokens per request from a filled DCP shard, k drafts verified per step.

    Run on every rank of the DCP ``group``. shard: this rank's cache holding
    every prompt's KV (capacity :func:`shard_capacity`); prompts: B token
    lists (the drafter's history); first: [B] the token after each prompt.
    ``drafter=None`` or k = 0 is plain DCP decode. ``graph``: False (eager),
    True (a DecodeRunner with backend "eager"), or a backend name
    (:func:`cpattn.graphs.backends.backends`; real groups only). Returns (tokens [B, steps],
    logits [B, steps, V] float32, :class:`SpecStats`), the same on every rank.
    """
    model = resolve_model(model)
    k = int(num_speculative_tokens) if drafter is not None else 0
    b = len(prompts)
    lens = [len(p) for p in prompts]  # tokens in the cache
    hist = [list(map(int, p)) + [int(f)] for p, f in zip(prompts, first.tolist())]
    out_tok: list[list[int]] = [[] for _ in range(b)]
    out_log: list[list[torch.Tensor]] = [[] for _ in range(b)]
    stats = SpecStats(accepted_hist=[0] * (k + 1))
    session = drafter.session(b, max(lens) + steps + k + 1) if k else None
    runner = make_verify_runner(group, model, params, cfg, shard, num_speculative_tokens=k, max_requests=b,
                                merge=merge, capture_sizes=capture_sizes,
                                backend=graph if isinstance(graph, str) else "eager") if graph else None
    while True:
        active = [i for i in range(b) if len(out_tok[i]) < steps]
        if not active:
            break
        drafts = session.propose([hist[i] for i in active], k, active) if k else torch.zeros(len(active), 0,
                                                                                             dtype=torch.int64)
        last = torch.tensor([hist[i][-1] for i in active], dtype=torch.int64)
        tokens = torch.cat([last[:, None], drafts], 1).flatten()  # [A * (1 + k)]
        seq = [lens[i] + 1 + k for i in active]
        table = shard.block_table[active]  # [A, max_blocks]
        if runner is not None:
            batch = {"tokens": tokens, "seq_lens": torch.tensor(seq), "block_table": table}
            logits = runner(batch, [1 + k] * len(active))  # [A * (1 + k), V]
            stats.graph_steps += runner.stats.last.startswith("graph")
        else:
            meta = dcp_plan(seq, [1 + k] * len(active), table, dcp_size=group.size,
                            interleave_size=shard.interleave_size, block_size=shard.block_size)
            logits = model.forward(params, cfg, tokens, DCPStep(group, shard, meta, merge)).float()
        logits = logits.view(len(active), 1 + k, -1)  # [A, 1 + k, V]
        greedy = logits.argmax(-1)  # [A, 1 + k]
        acc = accept_drafts(drafts, greedy).tolist()
        for j, i in enumerate(active):
            a = acc[j]
            new = greedy[j, : a + 1].tolist()
            hist[i].extend(new)
            lens[i] += 1 + a  # the last token and the accepted drafts; rejected rows lie past seq_len
            out_tok[i].extend(new)
            out_log[i].extend(logits[j, : a + 1])
            stats.accepted_hist[a] += 1
        stats.steps += 1
        stats.rows += len(active)
        stats.drafted += k * len(active)
        stats.accepted += sum(acc)
        stats.emitted += sum(acc) + len(active)
    if steps == 0:
        return torch.zeros(b, 0, dtype=torch.int64), torch.zeros(b, 0, 0), stats
    toks = torch.tensor([t[:steps] for t in out_tok], dtype=torch.int64)  # [B, steps]
    logs = torch.stack([torch.stack(lg[:steps]) for lg in out_log])  # [B, steps, V]
    return toks, logs, stats


def _first(pre, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    first_logits = pre.logits[torch.tensor(cu[1:]) - 1]  # [B, V]: each request's last prompt token
    return first_logits.argmax(-1), first_logits


def _assemble(pre, first, first_logits, toks, logs, stats) -> SpecGeneration:
    tokens = torch.cat([first[:, None], toks], 1)
    logits = torch.cat([first_logits[:, None], logs], 1) if logs.numel() else first_logits[:, None]
    return SpecGeneration(tokens, logits, pre.logits, stats)


def decode_from_prefill_on_rank(group: Group, model: ModuleType | str, params: dict, cfg: Any, pre, prompts: list,
                                steps: int, *, drafter=None, num_speculative_tokens: int = 0, block_size: int = 4,
                                interleave_size: int = 1, merge: str = "ag_rs", graph: bool = False,
                                capture_sizes: list[int] | None = None) -> SpecGeneration:
    """Fill this rank's DCP shard from a :class:`~cpattn.models.generate.PrefillResult`, then decode.

    Decoding is :func:`spec_decode_loop`; returns a :class:`SpecGeneration` (the same on every rank).
    """
    cu = pre.cu_seqlens.tolist()
    prompt_lens = [b - a for a, b in zip(cu, cu[1:])]
    k = num_speculative_tokens if drafter is not None else 0
    shard = PagedShard.empty(cfg, seq_lens=shard_capacity(prompt_lens, steps, k), dcp_size=group.size,
                             block_size=block_size, interleave_size=interleave_size, dtype=pre.k[0].dtype)
    fill_from_prefill(shard, group.rank, group.size, pre.k, pre.v, cu, pre.ik)
    first, first_logits = _first(pre, cu)
    toks, logs, stats = spec_decode_loop(group, model, params, cfg, shard, prompts, first, steps, drafter=drafter,
                                         num_speculative_tokens=k, merge=merge, graph=graph,
                                         capture_sizes=capture_sizes)
    return _assemble(pre, first, first_logits, toks, logs, stats)


def speculative_generate(model: ModuleType | str, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *,
                         drafter=None, num_speculative_tokens: int = 0, pcp_size: int = 1, dcp_size: int = 1,
                         pcp_method: str = "ring", block_size: int = 4, interleave_size: int = 1,
                         dcp_merge: str = "ag_rs", graph: bool = False,
                         capture_sizes: list[int] | None = None) -> SpecGeneration:
    """Greedy generation with speculative decoding: PCP prefill, then DCP verification steps (simulated mesh).

    Arguments
    ---------
    drafter: :class:`~cpattn.models.drafters.NgramDrafter`,
        :class:`~cpattn.models.drafters.ModelDrafter`, or None (plain decode).
    num_speculative_tokens: k >= 1 draft tokens per step (with a drafter).
    pcp_size / dcp_size: simulated ranks of the prefill / decode (dcp_size
        divides the attention heads). graph: verify through a DecodeRunner
        (capture sizes multiples of 1 + k; backend "eager" on the simulated mesh).
    Other arguments as :func:`cpattn.models.generate.generate`.

    Returns
    -------
    :class:`SpecGeneration`; ``tokens`` equal plain greedy generation's.
    """
    _check_spec(drafter, num_speculative_tokens)
    check_layout(cfg, max_new_tokens, pcp_size, dcp_size)
    if graph and capture_sizes is not None:  # fail here, not inside every simulated rank
        buckets.check_sizes(capture_sizes, num_speculative_tokens if drafter is not None else 0)
    tokens, cu = _packed(prompts)
    plist = [tokens[a:b].tolist() for a, b in zip(cu, cu[1:])]
    pre = prefill(model, params, cfg, tokens, cu, pcp_size=pcp_size, pcp_method=pcp_method)
    outs = simulate(dcp_size, decode_from_prefill_on_rank, model, params, cfg, pre, plist, max_new_tokens - 1,
                    drafter=drafter, num_speculative_tokens=num_speculative_tokens, block_size=block_size,
                    interleave_size=interleave_size, merge=dcp_merge, graph=graph, capture_sizes=capture_sizes)
    for r, o in enumerate(outs[1:], 1):
        if not torch.equal(o.tokens, outs[0].tokens):
            raise RuntimeError(f"DCP rank {r} generated different tokens than rank 0; the ranks diverged")
    return outs[0]


def speculative_generate_on_rank(group: Group, model: ModuleType | str, params: dict, cfg: Any, prompts: list,
                                 max_new_tokens: int, *, drafter=None, num_speculative_tokens: int = 0,
                                 pcp: bool = True, pcp_method: str = "ring", block_size: int = 4,
                                 interleave_size: int = 1, dcp_merge: str = "ag_rs", graph: bool = False,
                                 capture_sizes: list[int] | None = None) -> SpecGeneration:
    """:func:`speculative_generate` as one rank of a real group (PCP prefill and DCP decode over ``group``).

    Picklable arguments only (``model`` may be the family name); the drafter
    runs replicated on every rank. Example: ``spawn(2, speculative_generate_on_rank,
    "qwen3", params, cfg, prompts, 16, drafter=NgramDrafter(), num_speculative_tokens=3)``.
    """
    _check_spec(drafter, num_speculative_tokens)
    check_layout(cfg, max_new_tokens, group.size if pcp else 1, group.size)
    tokens, cu = _packed(prompts)
    plist = [tokens[a:b].tolist() for a, b in zip(cu, cu[1:])]
    if pcp and group.size > 1:
        pre = prefill_on_rank(group, model, params, cfg, tokens, cu, pcp_method=pcp_method)
    else:
        pre = prefill_local(model, params, cfg, tokens, cu)
    return decode_from_prefill_on_rank(group, model, params, cfg, pre, plist, max_new_tokens - 1, drafter=drafter,
                                       num_speculative_tokens=num_speculative_tokens, block_size=block_size,
                                       interleave_size=interleave_size, merge=dcp_merge, graph=graph,
                                       capture_sizes=capture_sizes)


def _check_spec(drafter, k: int) -> None:
    if drafter is not None and (not isinstance(k, int) or k < 1):
        raise ValueError(f"num_speculative_tokens must be an int >= 1 with a drafter; got {k!r}")
    if drafter is not None and not hasattr(drafter, "session"):
        raise TypeError(f"drafter must have .session(num_requests, max_len) (NgramDrafter, ModelDrafter); "
                        f"got {type(drafter).__name__}")
