"""DeepSeek Sparse Attention ops: lightning indexer, exact top-k, sparse MLA (DESIGN.md §4.4).

Three ops, each defined once in the registry (schema + fake + CPU kernel;
the plain references live in :mod:`cpattn.ops.dsa_ref`):

- ``indexer_scores`` (in :mod:`cpattn.ops.indexer`, re-exported here):
  the lightning indexer's scores of each query over its visible keys.
- ``topk_indices``: the k best columns per row in one strict total order,
  score descending then column ascending, so ties are broken the same way
  on every device and every shard; ``-1`` pads rows with fewer than k
  visible keys.
- ``sparse_mla_attention_with_lse``: absorbed MLA ("MQA" form, one latent KV
  head) over the selected cache rows only: keys are the ``Dqk = 576`` dim
  ``[latent 512 | rope 64]`` entries, values their first ``v_head_dim = 512``
  dims; ``-1`` indices are ignored; returns the fp32 LSE for merging.

The softmax scale is always explicit and is the model's:
``qk_head_dim**-0.5 * mscale**2`` (DeepSeek-V3.2: ``qk_head_dim = 128 + 64 =
192``; with YaRN ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``), never
``576**-0.5``; :func:`mla_softmax_scale` computes it.

:func:`selection_mismatch` reports how often a selection (FP8, bf16)
differs from the fp32 one.
"""

from __future__ import annotations

import math

import torch

from cpattn.ops import checks, dsa_ref, ref, registry
from cpattn.ops.indexer import (  # noqa: F401 - the DSA ops' names, one import for the callers
    CHUNK_ELEMS, causal_key_ranges, fp8_index_cache, fp8_quantize, indexer_scores,
)


# --------------------------------------------------------------------------- topk_indices
@registry.define("topk_indices")
def _topk_op(scores: torch.Tensor, k: int) -> torch.Tensor:
    raise registry.no_kernel("topk_indices", scores)


@registry.fake("topk_indices")
def _topk_fake(scores, k):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int32)


@registry.kernel("topk_indices", "cpu")
def _topk_cpu(scores, k):
    t, n = scores.shape
    kk = min(k, n)
    out = torch.full((t, k), -1, dtype=torch.int32, device=scores.device)
    if kk == 0 or t == 0:
        return out
    s = scores.masked_fill(scores.isnan(), float("-inf"))  # [T, S]
    thr = torch.topk(s, kk, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [T, 1] k-th best
    above = s > thr
    tied = s == thr
    need = kk - above.sum(-1, keepdim=True)  # ties to take, lowest column first
    take = above | (tied & (tied.cumsum(-1) <= need))  # exactly kk per row
    idx = take.nonzero()[:, 1].view(t, kk)  # [T, kk] ascending column
    vals = s.gather(1, idx)
    order = torch.sort(vals, dim=-1, descending=True, stable=True)  # score desc, column asc
    idx = idx.gather(1, order.indices)
    out[:, :kk] = torch.where(order.values == float("-inf"), -1, idx).to(torch.int32)
    return out


# --------------------------------------------------------------------------- sparse MLA
@registry.define("sparse_mla_attention_with_lse")
def _sparse_op(
    q: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor, softmax_scale: float, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    raise registry.no_kernel("sparse_mla_attention_with_lse", q)


@registry.fake("sparse_mla_attention_with_lse")
def _sparse_fake(q, latent, indices, softmax_scale, v_head_dim):
    t, h, _ = q.shape
    return q.new_empty(t, h, v_head_dim), q.new_empty(t, h, dtype=ref.acc_dtype(q, latent))


@registry.kernel("sparse_mla_attention_with_lse", "cpu")
def _sparse_cpu(q, latent, indices, softmax_scale, v_head_dim):
    acc = ref.acc_dtype(q, latent)
    t_all, h, d = q.shape
    kk = indices.shape[1]
    out = q.new_zeros(t_all, h, v_head_dim)
    lse = torch.full((t_all, h), float("-inf"), dtype=acc, device=q.device)
    if t_all == 0 or kk == 0 or latent.shape[0] == 0:
        return out, lse
    step = max(1, CHUNK_ELEMS // (kk * max(d, h)))
    for a in range(0, t_all, step):
        b = min(a + step, t_all)
        idx = indices[a:b].long()  # [n, K]
        valid = idx >= 0
        kv = latent.index_select(0, idx.clamp(min=0).flatten()).view(b - a, kk, d).to(acc)  # [n, K, D]
        all_valid = bool(valid.all())
        if not all_valid:
            kv = torch.where(valid[..., None], kv, 0.0)  # unselected rows may hold NaN
        s = torch.bmm(q[a:b].to(acc), kv.transpose(1, 2)).mul_(softmax_scale)  # [n, H, K]
        if not all_valid:
            s.masked_fill_(~valid[:, None, :], float("-inf"))
        # one exp pass: p = exp(s - max), lse = max + log(sum p); NaN in a selected row stays NaN
        mx = s.amax(-1)  # [n, H]
        live = mx != float("-inf")  # only a query without any index is zeroed
        p = torch.exp(s.sub_(torch.where(live, mx, 0.0)[..., None]))  # [n, H, K]
        total = p.sum(-1)  # [n, H]
        o = torch.bmm(p.div_(total[..., None]), kv[..., :v_head_dim])  # [n, H, Dv]
        out[a:b] = torch.where(live[..., None], o, 0.0).to(q.dtype)
        lse[a:b] = torch.where(live, mx + torch.log(total), float("-inf"))
    return out, lse


if torch.cuda.is_available():  # pragma: no cover - needs a GPU

    @registry.kernel("topk_indices", "cuda")
    def _topk_cuda(scores, k):
        return dsa_ref.topk_indices(scores, k)

    @registry.kernel("sparse_mla_attention_with_lse", "cuda")
    def _sparse_cuda(q, latent, indices, softmax_scale, v_head_dim):
        return dsa_ref.sparse_mla_attention_with_lse(q, latent, indices, softmax_scale, v_head_dim)


# --------------------------------------------------------------------------- public wrappers
def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best columns of each row: score descending, then column ascending.

    Arguments
    ---------
    scores: [T, S] -- ``-inf`` marks an invisible key (NaN counts as -inf).
    k: number of keys to keep (``index_topk``, 2048 in DeepSeek-V3.2).

    Returns
    -------
    indices: [T, k] int32, in the strict order above; ``-1`` fills the tail
    of rows with fewer than k visible keys. The order is total, so the
    result is the same on every device and equals a re-selection from any
    superset of candidates (what the key-sharded top-k relies on).

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.dsa import topk_indices
    >>> topk_indices(torch.tensor([[1.0, 3.0, 3.0, float("-inf")]]), 4).tolist()
    [[1, 2, 0, -1]]
    """
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores must be a floating [T, S] tensor; got {scores.dtype} {tuple(scores.shape)}")
    k = checks.integer("k", k, at_least=1)
    return torch.ops.cpattn.topk_indices(scores, k)


def sparse_mla_attention_with_lse(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    softmax_scale: float,
    v_head_dim: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over the top-k selected cache rows only.

    Arguments
    ---------
    q: [T, H, Dqk] -- absorbed queries ``[q_nope @ W_UK | q_rope]`` (Dqk = 576).
    latent_cache: [S, Dqk], [S, 1, Dqk] or paged [num_blocks, block_size, (1,) Dqk]
        -- one latent KV head; row s is ``[latent 512 | rope key 64]`` and its
        value is ``row[:v_head_dim]``. A paged cache is indexed by slot
        (``block_id * block_size + offset``).
    indices: [T, K] int -- cache rows each query attends; ``-1`` is ignored
        (and may repeat). Rows of one query must be distinct; a repeated row,
        or any other value outside the cache, is a ValueError naming the first
        one (not checked while tracing or capturing).
    softmax_scale: the model's scale (``qk_head_dim**-0.5 * mscale**2``, see
        :func:`mla_softmax_scale`), never ``Dqk**-0.5``. Required.
    v_head_dim: value width (512 for DeepSeek).

    Returns
    -------
    out: [T, H, v_head_dim] in q's dtype; lse: [T, H] float32 (float64 for
    float64 inputs). A query without any index gets out 0, lse -inf. Rows of
    the cache a query did not select never reach it (they may hold NaN); a
    NaN in a row it selected makes its output NaN, as in the dense oracle.

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.dsa import sparse_mla_attention_with_lse
    >>> q, cache = torch.randn(3, 4, 48), torch.randn(10, 48)
    >>> idx = torch.tensor([[0, 5, -1], [1, 2, 3], [-1, -1, -1]])
    >>> out, lse = sparse_mla_attention_with_lse(q, cache, idx, softmax_scale=0.1, v_head_dim=32)
    >>> out.shape, lse[2].tolist()
    (torch.Size([3, 4, 32]), [-inf, -inf, -inf, -inf])
    """
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a floating [T, H, Dqk] tensor; got {q.dtype} {tuple(q.shape)}")
    checks.same_device("q", q, latent_cache=latent_cache, indices=indices)
    d = q.shape[-1]
    if latent_cache.shape[-1] != d:
        raise ValueError(
            f"latent_cache rows have {latent_cache.shape[-1]} dims but q has {d}; both must be the "
            "absorbed [latent | rope] width (576 for DeepSeek)"
        )
    if latent_cache.dim() not in (2, 3, 4) or (latent_cache.dim() == 4 and latent_cache.shape[2] != 1):
        raise ValueError(
            f"latent_cache must be [S, Dqk], [S, 1, Dqk], [num_blocks, block_size, Dqk] or "
            f"[num_blocks, block_size, 1, Dqk] (one latent head); got shape {tuple(latent_cache.shape)}"
        )
    cache = latent_cache.reshape(-1, d)  # [S, Dqk]: flat rows / slots
    checks.int_tensor("indices", indices, dims=2, desc=f"[T={q.shape[0]}, K]")
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices must be an integer tensor [T={q.shape[0]}, K]; got {indices.dtype} {tuple(indices.shape)}")
    v_head_dim = checks.integer("v_head_dim", v_head_dim)
    if not 0 < v_head_dim <= d:
        raise ValueError(f"v_head_dim must be in 1..{d}; got {v_head_dim}")
    if softmax_scale is None or not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be the model's positive scale; got {softmax_scale}")
    rows = cache.shape[0]
    checks.distinct("indices", indices, low=-1, high=rows,
                    range_expected=f"-1 (no key) or a row of latent_cache in 0..{rows - 1} ({rows} rows)",
                    range_fix="For a paged cache a row is block_id * block_size + offset",
                    expected="distinct cache rows in each query's row (-1 may repeat): a repeated row counts its key "
                             "twice", fix="Pad a short selection with -1")
    return torch.ops.cpattn.sparse_mla_attention_with_lse(q, cache, indices, float(softmax_scale), int(v_head_dim))


def mla_softmax_scale(qk_head_dim: int, rope_factor: float | None = None, mscale_all_dim: float | None = None) -> float:
    """The MLA/DSA softmax scale: ``qk_head_dim**-0.5``, times ``mscale**2`` under YaRN.

    ``mscale = 0.1 * mscale_all_dim * ln(rope_factor) + 1`` when
    ``rope_factor > 1`` and ``mscale_all_dim`` is set. DeepSeek-V3.2:
    ``qk_head_dim = 192`` (128 nope + 64 rope), factor 40, mscale_all_dim 1.0.
    Never ``576**-0.5``: the absorbed width is not the model's head dim.

    Example
    -------
    >>> from cpattn.ops.dsa import mla_softmax_scale
    >>> round(mla_softmax_scale(192, 40, 1.0), 6)
    0.135234
    """
    scale = qk_head_dim**-0.5
    if rope_factor is not None and rope_factor > 1 and mscale_all_dim:
        m = 0.1 * mscale_all_dim * math.log(rope_factor) + 1.0
        scale *= m * m
    return scale


def selection_mismatch(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How two top-k selections ``[T, k]`` (``-1`` padded) differ, ignoring order.

    Returns ``{"rows_differ": fraction of rows whose sets differ,
    "recall": mean |a & b| / |b| over rows with a non-empty b}``.
    """
    if a.shape != b.shape:
        raise ValueError(f"selections differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    checks.same_device("a", a, b=b)
    sa, sb = a.long().sort(-1).values, b.long().sort(-1).values
    differ = (sa != sb).any(-1)
    hits = ((a.long()[:, :, None] == b.long()[:, None, :]) & (b.long()[:, None, :] >= 0)).any(-1).sum(-1)
    n_b = (b >= 0).sum(-1)
    live = n_b > 0
    recall = (hits[live].double() / n_b[live].double()).mean().item() if live.any() else 1.0
    return {"rows_differ": differ.double().mean().item() if a.shape[0] else 0.0, "recall": recall}
