"""DSA on one device: indexer -> top-k -> sparse MLA over a packed varlen batch.

The single-device meaning of the parallel forms in :mod:`cpattn.dsa.cp` and
:mod:`cpattn.dsa.dcp`; the float64 oracle is :mod:`cpattn.ops.dsa_ref`.
"""

from __future__ import annotations

import torch

from cpattn.ops import checks
from cpattn.ops.dsa import causal_key_ranges, indexer_scores, sparse_mla_attention_with_lse, topk_indices


def dsa_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    q_index: torch.Tensor,
    w_index: torch.Tensor,
    k_index: torch.Tensor,
    cu_seqlens_q: torch.Tensor | list[int],
    cu_seqlens_k: torch.Tensor | list[int],
    *,
    topk: int,
    softmax_scale: float,
    v_head_dim: int = 512,
    return_lse: bool = False,
    return_indices: bool = False,
):
    """DSA on one device over a packed varlen batch (bottom-right causal).

    Arguments
    ---------
    q: [Tq, H, Dqk] -- absorbed queries (Dqk = 576 = 512 latent + 64 rope).
    latent: [Tk, Dqk] -- one ``[latent | rope]`` entry per key token.
    q_index: [Tq, H_I, D_I]; w_index: [Tq, H_I]; k_index: [Tk, D_I] -- indexer.
    cu_seqlens_q, cu_seqlens_k: [B+1] -- request b's queries are the last
        ``Lq`` of its ``Lk`` key tokens (query i sees keys ``0 .. Lk-Lq+i``).
    topk: ``index_topk`` (2048 in DeepSeek-V3.2); softmax_scale: the model's.

    Returns
    -------
    out [Tq, H, v_head_dim]; with ``return_lse`` also lse [Tq, H] float32;
    with ``return_indices`` also the selected request-local key positions
    [Tq, topk] int32 (-1 padded), in (score desc, position asc) order.

    Example
    -------
    >>> import torch
    >>> from cpattn.dsa import dsa_attention
    >>> T, H = 6, 4
    >>> out = dsa_attention(torch.randn(T, H, 48), torch.randn(T, 48), torch.randn(T, 2, 16),
    ...                     torch.rand(T, 2), torch.randn(T, 16), [0, 6], [0, 6],
    ...                     topk=3, softmax_scale=0.1, v_head_dim=32)
    >>> out.shape
    torch.Size([6, 4, 32])
    """
    cq, ck = checks.int_list("cu_seqlens_q", cu_seqlens_q), checks.int_list("cu_seqlens_k", cu_seqlens_k)
    checks.cumulative("cu_seqlens_q", cq, total=q.shape[0], of=f"q has {q.shape[0]} tokens", exact=True)
    checks.cumulative("cu_seqlens_k", ck, total=latent.shape[0], of=f"latent has {latent.shape[0]} rows")
    if k_index.shape[0] != latent.shape[0]:
        raise ValueError(f"k_index has {k_index.shape[0]} rows but latent {latent.shape[0]}; one of each per key token")
    start, visible = causal_key_ranges(cq, ck)
    start, visible = start.to(q.device), visible.to(q.device)
    lens = [b - a for a, b in zip(ck, ck[1:])]
    scores = indexer_scores(q_index, w_index, k_index, start, visible, max(lens, default=0))  # [Tq, M]
    idx = topk_indices(scores, topk)  # [Tq, k] request-local positions
    rows = torch.where(idx >= 0, start[:, None] + idx, -1)  # [Tq, k] rows of latent
    out, lse = sparse_mla_attention_with_lse(q, latent, rows, softmax_scale=softmax_scale, v_head_dim=v_head_dim)
    res = (out,) + ((lse,) if return_lse else ()) + ((idx,) if return_indices else ())
    return res[0] if len(res) == 1 else res

