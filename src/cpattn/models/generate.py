"""Greedy generation: prefill (one device or PCP), then decode steps (one device or DCP).

The KV cache is passed explicitly from step to step. Prefill produces the
prompt logits and every layer's packed KV; decode starts from that KV:

- ``pcp_size == 1``: prefill on one device (:func:`prefill_local`).
- ``pcp_size == P > 1``: prompts split head-tail over P ranks
  (:func:`cpattn.pcp_plan` / :func:`cpattn.pcp_shard`, global positions from
  the plan), attention through :func:`cpattn.pcp_prefill` (DSA models:
  :func:`cpattn.dsa.dsa_cp_attention`); the ranks' logits and KV are
  all-gathered into request order, as a prefill engine hands its KV to a
  decode engine (:func:`prefill_on_rank`).
- ``dcp_size == 1``: decode on one device with a dense cache (:func:`decode_dense`).
- ``dcp_size == N > 1``: decode on N ranks, each holding its interleaved
  share of a paged cache (:func:`cpattn.models.dcp_cache.decode_dcp_on_rank`).

:func:`generate` runs the ranks on the simulated mesh; :func:`generate_on_rank`
is the same program for one rank of a real group (gloo processes, torchrun).

No sampling and no end-of-sequence handling: exactly ``max_new_tokens``
argmax tokens per request (ties go to the lowest token id).

Example
-------
>>> import torch
>>> from cpattn.models import qwen3
>>> from cpattn.models.generate import generate
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> params = qwen3.init_params(cfg, seed=0)
>>> out = generate(qwen3, params, cfg, [[1, 2, 3], [4, 5]], 4, pcp_size=2)
>>> out.tokens.shape
torch.Size([2, 4])
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.comm.sim import simulate
from cpattn.layout.pcp import pcp_plan, pcp_shard
from cpattn.dsa import dsa_cp_plan, dsa_cp_shard
from cpattn.models import resolve_model
from cpattn.models.cache import DenseKVCache, DSACPStep, PCPStep
from cpattn.models.dcp_cache import decode_dcp_on_rank


@dataclass(frozen=True)
class Generation:
    """Result of :func:`generate`.

    tokens: [B, N] int64 generated tokens; logits: [B, N, V] float32, the
    logits each token was chosen from; prompt_logits: [T, V] float32, the
    prefill logits of every packed prompt token.
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    prompt_logits: torch.Tensor


@dataclass(frozen=True)
class PrefillResult:
    """Prompt logits [T, V] (float32) and per-layer packed KV in request order.

    k[l]: [T, Hkv, Dk]; v[l]: [T, Hkv, Dv] or None (MLA latent rows);
    ik[l]: [T, D_I] DSA indexer keys or None; cu_seqlens: [B+1].
    """

    logits: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor | None]
    cu_seqlens: torch.Tensor
    ik: list[torch.Tensor] | None = None


def _packed(prompts) -> tuple[torch.Tensor, list[int]]:
    seqs = [torch.as_tensor(p, dtype=torch.int64).flatten() for p in prompts]
    if not seqs or any(s.numel() == 0 for s in seqs):
        raise ValueError("prompts must be a non-empty list of non-empty token sequences")
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + s.numel())
    return torch.cat(seqs), cu


def uses_dsa(cfg: Any) -> bool:
    """True for DeepSeek Sparse Attention models (configs with ``index_topk``)."""
    return hasattr(cfg, "index_topk")


def prefill_local(
    model: ModuleType | str, params: dict, cfg: Any, tokens: torch.Tensor, cu_seqlens: list[int]
) -> PrefillResult:
    """Prefill on one device: a dense cache and :func:`cpattn.ops.attention_with_lse` (or DSA).

    tokens: [T] packed prompts, requests by ``cu_seqlens`` [B+1]. Returns a :class:`PrefillResult`.
    """
    model = resolve_model(model)
    n = cfg.num_hidden_layers
    lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    cache = model.empty_cache(cfg, batch=len(lens), max_len=max(lens), dtype=_dtype(params), device=tokens.device)
    step = cache.step(lens)
    logits = model.forward(params, cfg, tokens, step)  # [T, V]

    def packed(ts):
        return None if ts is None or ts[0] is None else [torch.cat([t[b, :m] for b, m in enumerate(lens)]) for t in ts]

    return PrefillResult(logits.float(), packed(cache.k), packed(cache.v) or [None] * n,
                         torch.tensor(cu_seqlens, dtype=torch.int32), packed(cache.ik))


def split_prefill(group: Group, cfg: Any, tokens: torch.Tensor, cu_seqlens: list[int], *, pcp_method: str = "ring",
                  dsa_split: str = "balanced"):
    """This rank's share of a prefill: (plan, attention step, its tokens [T_r]).

    GQA/MLA: head-tail PCP plan and a :class:`PCPStep`; DSA: a DSA-CP plan
    (``dsa_split``) and a :class:`DSACPStep`.
    """
    _, _, dv, _ = cfg.kv_dims
    if uses_dsa(cfg):
        plan = dsa_cp_plan(cu_seqlens, group.size, split=dsa_split)
        return plan, DSACPStep(group, plan, dv), dsa_cp_shard(tokens, plan, group.rank)
    plan = pcp_plan(cu_seqlens, group.size)
    return plan, PCPStep(group, plan, dv, method=pcp_method), pcp_shard(tokens, plan, group.rank)


def prefill_on_rank(group: Group, model: ModuleType | str, params: dict, cfg: Any, tokens: torch.Tensor,
                    cu_seqlens: list[int], *, pcp_method: str = "ring", dsa_split: str = "balanced") -> PrefillResult:
    """Prefill with the prompts' tokens split over ``group`` (run it on every rank).

    GQA/MLA models: head-tail PCP split, attention by :func:`cpattn.pcp_prefill`
    (``pcp_method`` "ring" or "allgather"). DSA models:
    :func:`cpattn.dsa.dsa_cp_attention` with ``dsa_split`` ("balanced": the
    PCP head-tail chunks; "contiguous": the guide's DSA-CP). RoPE uses the
    plan's global positions. The ranks' logits and KV are then all-gathered
    and put in request order, so every rank returns the full
    :class:`PrefillResult` (as a prefill engine hands its KV on).
    """
    model = resolve_model(model)
    n = cfg.num_hidden_layers
    plan, step, mine = split_prefill(group, cfg, tokens, cu_seqlens, pcp_method=pcp_method, dsa_split=dsa_split)
    logits = model.forward(params, cfg, mine, step).float()  # [T_r, V]

    def gather(xs):
        return None if xs[0] is None else [gather_unshard(group, x, plan) for x in xs]

    k, v, ik = (gather([step.kv[l][j] for l in range(n)]) for j in range(3))
    return PrefillResult(gather_unshard(group, logits, plan), k, v or [None] * n,
                         torch.tensor(cu_seqlens, dtype=torch.int32), ik)


def gather_unshard(group: Group, x: torch.Tensor, plan: Any) -> torch.Tensor:
    """All-gather every rank's [T_r, ...] rows of a token split and restore request order: -> [T, ...].

    ``plan`` is a :class:`cpattn.PCPPlan` or :class:`cpattn.dsa.DSACPPlan`
    (``num_tokens``, ``max_tokens``, ``restore_index``). One all-gather, padded to ``max_tokens``.
    """
    t_max = plan.max_tokens
    flat = x.reshape(x.shape[0], -1)  # [T_r, F]
    flat = torch.nn.functional.pad(flat, (0, 0, 0, t_max - flat.shape[0]))  # [t_max, F]
    everything = group.all_gather(flat)  # [P * t_max, F], rank-major
    rows = torch.cat([everything[j * t_max : j * t_max + m] for j, m in enumerate(plan.num_tokens)])
    return rows[plan.restore_index.to(rows.device)].view(-1, *x.shape[1:])


def prefill(model: ModuleType | str, params: dict, cfg: Any, tokens: torch.Tensor, cu_seqlens: list[int], *,
            pcp_size: int = 1, pcp_method: str = "ring", dsa_split: str = "balanced") -> PrefillResult:
    """Prefill on one device (``pcp_size == 1``) or on ``pcp_size`` simulated ranks (:func:`prefill_on_rank`)."""
    if pcp_size == 1:
        return prefill_local(model, params, cfg, tokens, cu_seqlens)
    return simulate(pcp_size, prefill_on_rank, model, params, cfg, tokens, cu_seqlens,
                    pcp_method=pcp_method, dsa_split=dsa_split)[0]


def decode_dense(model: ModuleType | str, params: dict, cfg: Any, pre: PrefillResult, first: torch.Tensor, steps: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` greedy decode steps on one device from the prefill KV.

    first: [B] the token chosen from the prefill logits. Returns (tokens
    [B, steps], logits [B, steps, V]) of the tokens chosen after each step.
    """
    model = resolve_model(model)
    cu = pre.cu_seqlens.tolist()
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    _, _, dv, _ = cfg.kv_dims
    cache = DenseKVCache.from_packed(pre.k, pre.v, cu, max_len=longest + steps, dv=dv, ik=pre.ik)
    tok, toks, logits = first, [], []
    for _ in range(steps):
        step = cache.step([1] * tok.numel())
        out = model.forward(params, cfg, tok, step).float()  # [B, V]
        cache = step.finish()
        tok = out.argmax(-1)
        toks.append(tok)
        logits.append(out)
    return _stack(toks, logits, first.numel())


def _dtype(params: dict) -> torch.dtype:
    return params["model.embed_tokens.weight"].dtype


def _stack(toks, logits, b):
    if not toks:
        return torch.zeros(b, 0, dtype=torch.int64), torch.zeros(b, 0, 0)
    return torch.stack(toks, 1), torch.stack(logits, 1)


def generate(
    model: ModuleType,
    params: dict,
    cfg: Any,
    prompts: list,
    max_new_tokens: int,
    *,
    pcp_size: int = 1,
    dcp_size: int = 1,
    pcp_method: str = "ring",
    block_size: int = 4,
    interleave_size: int = 1,
    dcp_merge: str = "ag_rs",
    dsa_split: str = "balanced",
) -> Generation:
    """Greedy generation of ``max_new_tokens`` tokens for each prompt.

    Arguments
    ---------
    model: a model module (:mod:`cpattn.models.qwen3`, ``deepseek_v3``,
        ``deepseek_v32``) with ``forward(params, cfg, tokens, attn)``.
    prompts: B token sequences (lists or 1-D tensors), any lengths >= 1.
    pcp_size: PCP ranks for prefill; dcp_size: DCP ranks for decode
        (both on the simulated mesh). pcp_method: "ring" or "allgather".
    block_size, interleave_size: the paged cache layout for DCP decode;
        dcp_merge: "ag_rs" or "a2a" (see :func:`cpattn.dcp.dcp_decode`).
    dsa_split: how a DSA model's prefill splits tokens over the ``pcp_size``
        ranks: "balanced" (head-tail, as PCP) or "contiguous" (DSA-CP).

    Returns
    -------
    :class:`Generation` (tokens [B, N], logits [B, N, V], prompt_logits [T, V]).
    """
    check_layout(cfg, max_new_tokens, pcp_size, dcp_size)
    tokens, cu = _packed(prompts)
    pre = prefill(model, params, cfg, tokens, cu, pcp_size=pcp_size, pcp_method=pcp_method, dsa_split=dsa_split)
    if dcp_size == 1:
        return _decode(pre, cu, max_new_tokens, lambda first, steps: decode_dense(model, params, cfg, pre, first, steps))
    def run(first, steps):
        outs = simulate(dcp_size, decode_dcp_on_rank, model, params, cfg, pre, first, steps, block_size=block_size,
                        interleave_size=interleave_size, merge=dcp_merge)
        for r, (t, _) in enumerate(outs[1:], 1):
            if not torch.equal(t, outs[0][0]):
                raise RuntimeError(f"DCP rank {r} generated different tokens than rank 0; the ranks diverged")
        return outs[0]

    return _decode(pre, cu, max_new_tokens, run)


def check_layout(cfg: Any, max_new_tokens: int, pcp_size: int, dcp_size: int) -> None:
    """Raise ValueError for a generation layout the models cannot run (before any rank starts)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if pcp_size < 1 or dcp_size < 1:
        raise ValueError(f"pcp_size and dcp_size must be >= 1; got pcp_size={pcp_size}, dcp_size={dcp_size}")
    heads = cfg.num_attention_heads
    if dcp_size > 1 and not uses_dsa(cfg) and heads % dcp_size:
        raise ValueError(
            f"dcp_size={dcp_size} does not divide the {heads} attention heads; DCP reuses TP ranks, so the "
            f"DCP size must divide the number of attention heads. Pick one of "
            f"{[d for d in range(1, heads + 1) if heads % d == 0]}"
        )


def _decode(pre: PrefillResult, cu: list[int], max_new_tokens: int, run) -> Generation:
    """First token from the prefill logits, the rest from ``run(first, steps)``."""
    first_logits = pre.logits[torch.tensor(cu[1:]) - 1]  # [B, V]: each request's last prompt token
    first = first_logits.argmax(-1)
    toks, logits = run(first, max_new_tokens - 1)
    all_toks = torch.cat([first[:, None], toks], 1)
    all_logits = torch.cat([first_logits[:, None], logits], 1) if logits.numel() else first_logits[:, None]
    return Generation(all_toks, all_logits, pre.logits)


def generate_on_rank(group: Group, model: ModuleType | str, params: dict, cfg: Any, prompts: list, max_new_tokens: int,
                     *, pcp: bool = True, dcp: bool = True, pcp_method: str = "ring", block_size: int = 4,
                     interleave_size: int = 1, dcp_merge: str = "ag_rs", dsa_split: str = "balanced") -> Generation:
    """:func:`generate` as one rank of a real (or simulated) group: run it on every rank.

    ``pcp``: prefill split over ``group`` (else every rank prefills alone);
    ``dcp``: decode with the KV cache sharded over ``group`` (else each rank
    decodes alone). Like a P/D pair that shares its devices. Every rank returns
    the same :class:`Generation`. Picklable arguments only (``model`` may be
    the family name), so it serves :func:`cpattn.comm.launch.spawn` and torchrun.

    Example
    -------
    >>> from cpattn.comm.launch import spawn
    >>> gens = spawn(2, generate_on_rank, "qwen3", params, cfg, [[1, 2, 3]], 8)  # doctest: +SKIP
    """
    check_layout(cfg, max_new_tokens, group.size if pcp else 1, group.size if dcp else 1)
    tokens, cu = _packed(prompts)
    if pcp and group.size > 1:
        pre = prefill_on_rank(group, model, params, cfg, tokens, cu, pcp_method=pcp_method, dsa_split=dsa_split)
    else:
        pre = prefill_local(model, params, cfg, tokens, cu)
    if not (dcp and group.size > 1):
        return _decode(pre, cu, max_new_tokens, lambda first, steps: decode_dense(model, params, cfg, pre, first, steps))
    return _decode(pre, cu, max_new_tokens, lambda first, steps: decode_dcp_on_rank(
        group, model, params, cfg, pre, first, steps, block_size=block_size, interleave_size=interleave_size,
        merge=dcp_merge))
