"""PCP prefill that writes its KV straight into the DCP-sharded layout of the same ranks, then DCP decode.

The guide forbids PCP and DCP together; this lifts it, opt-in through
``ParallelConfig(allow_pcp_with_dcp=True)`` (see docs/pcp_with_dcp.md).
One group of P ranks is the PCP group for prefill and the DCP group for
decode (N = P). After the PCP forward, rank r holds the K/V of its
head-tail chunks, but the DCP layout wants token t on rank ``(t // I) % N``.
Every rank knows the whole plan, so the moves are known on the host without
any message about them::

    rank r's rows  --group by DCP owner, pad to M rows per pair-->  [N, M, L*F]
                   --one all_to_all (every layer at once)-->         rows I own
                   --dcp_slot_mapping (pos, req from the plan)-->    write into my shard

Why an all-to-all and not "all-gather, keep my tokens": each rank needs
only 1/N of the tokens, so it should receive only those; the all-gather
brings every rank all T rows ((P-1)/P * T received per rank), the
all-to-all about (N-1)/N * T/N plus padding -- about P times fewer bytes
(``exchange="allgather"`` is kept for comparison). A ring PCP prefill could
keep owned tokens as the K/V pass by at no extra traffic; that needs a hook
inside :func:`cpattn.pcp_prefill` and is not done here.

Only the requests' last-token logits leave their rank: one all_reduce of
[B, V] gives every rank the first tokens (no [T, V] gather).

Example
-------
>>> import torch
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> pc = pcp_dcp_config(cfg, 2, block_size=4, interleave_size=1)
>>> out = pcp_dcp_generate(qwen3, qwen3.init_params(cfg), cfg, [[1, 2, 3, 4, 5]], 4, config=pc)
>>> out.tokens.shape
torch.Size([1, 4])
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.comm.sim import simulate
from cpattn.config import EngineConfig
from cpattn.layout.dcp import dcp_owner, dcp_slot_mapping
from cpattn.models import resolve_model
from cpattn.models.dcp_cache import PagedShard
from cpattn.models.disagg import attention_kind, decode_engine_tp
from cpattn.models.generate import _packed, check_layout, split_prefill, uses_dsa
from cpattn.models.kv_rows import pack_rows, row_layout, unpack_rows
from cpattn.models.speculative import SpecGeneration, _check_spec, shard_capacity, spec_decode_loop

EXCHANGES = ("a2a", "allgather")


def pcp_dcp_config(cfg: Any, size: int, *, block_size: int = 4, interleave_size: int = 1,
                   allow_pcp_with_dcp: bool = True, **over) -> EngineConfig:
    """A :class:`~cpattn.config.ParallelConfig` with ``pcp_size == dcp_size == size`` for a model config.

    tp_size is :func:`cpattn.models.disagg.decode_engine_tp` (the models keep
    every KV head on every DCP rank). ``allow_pcp_with_dcp=False`` gives the
    guide's answer: a ValueError.

    Example
    -------
    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> pcp_dcp_config(cfg, 2).parallel.allow_pcp_with_dcp
    True
    """
    kind = attention_kind(cfg)
    return EngineConfig.create(tp_size=decode_engine_tp(cfg, size), pcp_size=size, dcp_size=size, attention=kind,
                          num_kv_heads=cfg.kv_dims[0] if kind == "gqa" else None, block_size=block_size,
                          cp_kv_cache_interleave_size=interleave_size, allow_pcp_with_dcp=allow_pcp_with_dcp,
                          **over)


@dataclass(frozen=True)
class PrefillFacts:
    """What one rank's PCP+DCP prefill did: rows_sent/rows_kept (own tokens), exchange_bytes (sent to
    other ranks by the KV exchange, padding included), ready_s (start -> shard filled, first token known)."""

    rows_sent: int
    rows_kept: int
    exchange_bytes: int
    ready_s: float


def owner_moves(plan, *, dcp_size: int, interleave_size: int):
    """Host-side plan of the KV exchange, the same on every rank.

    For each PCP rank j: ``owner[j]`` [T_j] DCP owner of each local row,
    ``req[j]`` / ``pos[j]`` [T_j] its request and position; ``counts``
    [P, N] rows rank j sends to DCP rank d; ``m`` = max count (the padded
    per-pair size of the all-to-all).
    """
    cu = plan.cu_seqlens.to(torch.int64)
    owner, req, pos = [], [], []
    for j in range(plan.size):
        idx = plan.token_index[j].to(torch.int64)
        rq = torch.searchsorted(cu[1:].contiguous(), idx, right=True)  # [T_j]
        p = plan.positions[j].to(torch.int64)
        owner.append(dcp_owner(p, dcp_size, interleave_size))
        req.append(rq)
        pos.append(p)
    counts = torch.stack([torch.bincount(o, minlength=dcp_size) for o in owner])  # [P, N]
    return owner, req, pos, counts, int(counts.max()) if counts.numel() else 0


def exchange_to_owners(group: Group, rows: torch.Tensor, plan, *, interleave_size: int, exchange: str = "a2a"):
    """Move this rank's PCP rows to their DCP owners (the same group).

    rows: [T_r, L, F] this rank's KV rows in the plan's local order.
    Returns (rows [R, L, F], req [R], pos [R], bytes sent to other ranks)
    for the R tokens this rank owns under the DCP layout.
    """
    n, r = group.size, group.rank
    owner, req, pos, counts, m = owner_moves(plan, dcp_size=n, interleave_size=interleave_size)
    feat = rows.shape[1:]
    if exchange == "allgather":
        t_max = plan.max_tokens
        pad = rows.new_zeros(t_max, *feat)
        pad[: rows.shape[0]] = rows
        every = group.all_gather(pad[None], dim=0)  # [P, t_max, L, F]
        got = [every[j, : owner[j].numel()][owner[j] == r] for j in range(n)]
        sent = t_max * rows[0].numel() * rows.element_size() * (n - 1) if rows.numel() else 0
    elif exchange == "a2a":
        buf = rows.new_zeros(n, m, *feat)  # [N, M, L, F]: slice d goes to DCP rank d
        for d in range(n):
            mine = rows[owner[r] == d]
            buf[d, : mine.shape[0]] = mine
        recv = group.all_to_all(buf, dim=0)  # [N, M, L, F]: slice j came from rank j
        got = [recv[j, : int(counts[j, r])] for j in range(n)]
        sent = m * buf[0, 0].numel() * buf.element_size() * (n - 1)
    else:
        raise ValueError(f"exchange must be one of {EXCHANGES}; got {exchange!r}")
    req_mine = torch.cat([req[j][owner[j] == r] for j in range(n)])
    pos_mine = torch.cat([pos[j][owner[j] == r] for j in range(n)])
    return torch.cat(got), req_mine, pos_mine, sent


def pcp_dcp_prefill_on_rank(group: Group, model: ModuleType | str, params: dict, cfg: Any, tokens: torch.Tensor,
                            cu_seqlens: list[int], shard: PagedShard, *, pcp_method: str = "ring",
                            exchange: str = "a2a") -> tuple[torch.Tensor, torch.Tensor, PrefillFacts]:
    """PCP prefill over ``group`` writing this rank's DCP share of every prompt's KV into ``shard``.

    tokens: [T] packed prompts by ``cu_seqlens`` [B+1]; shard: this rank's
    empty paged shard (``dcp_size == group.size``). GQA/MLA prefill through
    :func:`cpattn.pcp_prefill`, DSA through DSA-CP with the balanced split.
    Returns (first tokens [B], their logits [B, V] float32, :class:`PrefillFacts`).
    """
    model = resolve_model(model)
    t0 = time.perf_counter()
    n_layers = cfg.num_hidden_layers
    plan, step, mine = split_prefill(group, cfg, tokens, cu_seqlens, pcp_method=pcp_method)
    logits = model.forward(params, cfg, mine, step).float()  # [T_r, V]
    # first tokens: the last prompt token's logits, from whichever rank holds it
    idx = plan.token_index[group.rank].to(torch.int64)  # [T_r]
    last = torch.tensor(cu_seqlens[1:], dtype=torch.int64) - 1  # [B]
    hit = idx[:, None] == last[None, :]  # [T_r, B]
    first_logits = group.all_reduce(hit.to(logits.dtype).T @ logits)  # [B, V]: one nonzero term per request
    ks = [step.kv[layer][0] for layer in range(n_layers)]
    vs = [step.kv[layer][1] for layer in range(n_layers)]
    iks = [step.kv[layer][2] for layer in range(n_layers)] if uses_dsa(cfg) else None
    rows = pack_rows(ks, vs, iks)  # [T_r, L, F]
    got, req, pos, sent = exchange_to_owners(group, rows, plan, interleave_size=shard.interleave_size,
                                             exchange=exchange)
    slots = dcp_slot_mapping(pos, req, shard.block_table, dcp_rank=group.rank, dcp_size=group.size,
                             interleave_size=shard.interleave_size, block_size=shard.block_size)
    k, v, ik = unpack_rows(got, **row_layout(cfg))
    for layer in range(n_layers):
        shard.write(layer, k[layer], v[layer], slots, None if ik is None else ik[layer])
    kept = int(_owned(plan, group, shard).sum())
    facts = PrefillFacts(rows_sent=int(rows.shape[0]) - kept, rows_kept=kept, exchange_bytes=sent,
                         ready_s=time.perf_counter() - t0)
    return first_logits.argmax(-1), first_logits, facts


def _owned(plan, group, shard) -> torch.Tensor:
    """[T_r] bool: which of this rank's PCP rows it also owns under DCP."""
    p = plan.positions[group.rank].to(torch.int64)
    return dcp_owner(p, group.size, shard.interleave_size) == group.rank


@dataclass(frozen=True)
class PCPDCPResult:
    """A rank's :class:`~cpattn.models.speculative.SpecGeneration` (prompt_logits empty) and :class:`PrefillFacts`."""

    generation: SpecGeneration
    prefill: PrefillFacts


def _check_config(config: EngineConfig, size: int) -> None:
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be a cpattn.config.EngineConfig; got {type(config).__name__}")
    if config.parallel.pcp_size != size or config.parallel.dcp_size != size:
        raise ValueError(
            f"config has pcp_size={config.parallel.pcp_size}, dcp_size={config.parallel.dcp_size} but the group has {size} ranks; "
            f"PCP+DCP here uses the same ranks for both: pass pcp_size = dcp_size = {size} "
            "(cpattn.models.pcp_dcp.pcp_dcp_config builds one)"
        )


def pcp_dcp_generate_on_rank(group: Group, model: ModuleType | str, params: dict, cfg: Any, prompts: list,
                             max_new_tokens: int, *, config: EngineConfig, pcp_method: str = "ring",
                             exchange: str = "a2a", drafter=None, num_speculative_tokens: int = 0,
                             dcp_merge: str = "ag_rs", graph: bool = False) -> PCPDCPResult:
    """PCP prefill into the DCP layout, then DCP decode (optionally speculative), on every rank of ``group``.

    config: a :class:`~cpattn.config.ParallelConfig` with ``pcp_size ==
    dcp_size == group.size`` and ``allow_pcp_with_dcp=True`` (the guide's
    default refuses PCP with DCP when the config is built); its block_size
    and cp_kv_cache_interleave_size set the cache layout.
    """
    _check_config(config, group.size)
    _check_spec(drafter, num_speculative_tokens)
    check_layout(cfg, max_new_tokens, group.size, group.size)
    tokens, cu = _packed(prompts)
    plist = [tokens[a:b].tolist() for a, b in zip(cu, cu[1:])]
    k = num_speculative_tokens if drafter is not None else 0
    steps = max_new_tokens - 1
    shard = PagedShard.empty(cfg, seq_lens=shard_capacity([len(p) for p in plist], steps, k), dcp_size=group.size,
                             block_size=config.cache.block_size, interleave_size=config.cache.cp_kv_cache_interleave_size,
                             dtype=params["model.embed_tokens.weight"].dtype)
    first, first_logits, facts = pcp_dcp_prefill_on_rank(group, model, params, cfg, tokens, cu, shard,
                                                         pcp_method=pcp_method, exchange=exchange)
    toks, logs, stats = spec_decode_loop(group, model, params, cfg, shard, plist, first, steps, drafter=drafter,
                                         num_speculative_tokens=k, merge=dcp_merge, graph=graph)
    gen = SpecGeneration(torch.cat([first[:, None], toks], 1),
                         torch.cat([first_logits[:, None], logs], 1) if logs.numel() else first_logits[:, None],
                         first_logits.new_zeros(0, first_logits.shape[-1]), stats)
    return PCPDCPResult(gen, facts)


def pcp_dcp_generate(model: ModuleType | str, params: dict, cfg: Any, prompts: list, max_new_tokens: int, *,
                     config: EngineConfig, **kw) -> SpecGeneration:
    """:func:`pcp_dcp_generate_on_rank` on ``config.pcp_size`` simulated ranks; returns rank 0's generation."""
    _check_config(config, config.parallel.pcp_size)
    outs = simulate(config.parallel.pcp_size, pcp_dcp_generate_on_rank, model, params, cfg, prompts, max_new_tokens,
                    config=config, **kw)
    for r, o in enumerate(outs[1:], 1):
        if not torch.equal(o.generation.tokens, outs[0].generation.tokens):
            raise RuntimeError(f"rank {r} generated different tokens than rank 0; the ranks diverged")
    return outs[0].generation
