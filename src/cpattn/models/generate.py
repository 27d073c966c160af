"""Greedy generation: prefill (one device or PCP), then decode steps (one device or DCP).

The KV cache is passed explicitly from step to step. Prefill produces the
prompt logits and every layer's packed KV; decode starts from that KV:

- ``pcp_size == 1``: prefill on one device.
- ``pcp_size == P > 1``: prompts split head-tail over P simulated ranks
  (:func:`cpattn.pcp_plan` / :func:`cpattn.pcp_shard`, global positions from
  the plan), attention through :func:`cpattn.pcp_prefill`; the ranks' logits
  and KV are put back in request order (``pcp_unshard``), as a prefill
  engine hands its KV to a decode engine.
- ``dcp_size == 1``: decode on one device with a dense cache.
- ``dcp_size == N > 1``: decode on N simulated ranks, each holding its
  interleaved share of a paged cache (:mod:`cpattn.models.dcp_cache`).

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

from cpattn.comm.sim import simulate
from cpattn.layout.pcp import pcp_plan, pcp_shard, pcp_unshard
from cpattn.models.cache import DenseKVCache, DSACPStep, PCPStep


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


def prefill(model: ModuleType, params: dict, cfg: Any, tokens: torch.Tensor, cu_seqlens: list[int], *,
            pcp_size: int = 1, pcp_method: str = "ring", dsa_split: str = "balanced") -> PrefillResult:
    """Run the prompts [T] (requests by ``cu_seqlens``) through ``model``, split over ``pcp_size`` ranks.

    One rank: a dense cache and :func:`cpattn.ops.attention_with_lse` (or
    :func:`cpattn.dsa.dsa_attention`). More: the simulated mesh, with
    :func:`cpattn.pcp_prefill` over a head-tail split, or for DSA models
    :func:`cpattn.dsa.dsa_cp_attention` with ``dsa_split`` ("balanced": the
    PCP head-tail chunks; "contiguous": the guide's DSA-CP). Returns a
    :class:`PrefillResult` in request order.
    """
    _, _, dv, _ = cfg.kv_dims
    n = cfg.num_hidden_layers
    cu_t = torch.tensor(cu_seqlens, dtype=torch.int32)
    if pcp_size == 1:
        lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        cache = model.empty_cache(cfg, batch=len(lens), max_len=max(lens), dtype=_dtype(params), device=tokens.device)
        step = cache.step(lens)
        logits = model.forward(params, cfg, tokens, step)  # [T, V]

        def packed(ts):
            return None if ts is None or ts[0] is None else [torch.cat([t[b, :m] for b, m in enumerate(lens)]) for t in ts]

        return PrefillResult(logits.float(), packed(cache.k), packed(cache.v) or [None] * n, cu_t, packed(cache.ik))
    if uses_dsa(cfg):
        from cpattn.dsa import dsa_cp_plan, dsa_cp_shard, dsa_cp_unshard

        plan = dsa_cp_plan(cu_seqlens, pcp_size, split=dsa_split)
        shard, unshard = dsa_cp_shard, dsa_cp_unshard
    else:
        plan = pcp_plan(cu_seqlens, pcp_size)
        shard, unshard = pcp_shard, pcp_unshard

    def rank_fn(group):
        step = DSACPStep(group, plan, dv) if uses_dsa(cfg) else PCPStep(group, plan, dv, method=pcp_method)
        logits = model.forward(params, cfg, shard(tokens, plan, group.rank), step)  # [T_r, V]
        return logits, [step.kv[l] for l in range(n)]

    parts = simulate(pcp_size, rank_fn)

    def gather(l, j):
        return None if parts[0][1][l][j] is None else unshard([r[1][l][j] for r in parts], plan)

    k, v, ik = ([gather(l, j) for l in range(n)] for j in range(3))
    return PrefillResult(unshard([r[0] for r in parts], plan).float(), k, v, cu_t, None if ik[0] is None else ik)


def decode_dense(model: ModuleType, params: dict, cfg: Any, pre: PrefillResult, first: torch.Tensor, steps: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` greedy decode steps on one device from the prefill KV.

    first: [B] the token chosen from the prefill logits. Returns (tokens
    [B, steps], logits [B, steps, V]) of the tokens chosen after each step.
    """
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
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    tokens, cu = _packed(prompts)
    pre = prefill(model, params, cfg, tokens, cu, pcp_size=pcp_size, pcp_method=pcp_method, dsa_split=dsa_split)
    last = torch.tensor(cu[1:]) - 1
    first_logits = pre.logits[last]  # [B, V]
    first = first_logits.argmax(-1)
    if dcp_size == 1:
        toks, logits = decode_dense(model, params, cfg, pre, first, max_new_tokens - 1)
    else:
        from cpattn.models.dcp_cache import decode_dcp

        toks, logits = decode_dcp(model, params, cfg, pre, first, max_new_tokens - 1, dcp_size=dcp_size,
                                  block_size=block_size, interleave_size=interleave_size, merge=dcp_merge)
    all_toks = torch.cat([first[:, None], toks], 1)
    all_logits = torch.cat([first_logits[:, None], logits], 1) if logits.numel() else first_logits[:, None]
    return Generation(all_toks, all_logits, pre.logits)
