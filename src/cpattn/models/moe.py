"""Mixture-of-experts blocks: routers and the exact routed-expert sum.

Routers (in float32, as the reference implementations; in float64 for float64
activations, so a float64 run stays an exact oracle: a float32 router there
would round two float64 paths that differ in their last bits -- or one
float32 GEMM whose blocking follows the row count -- to router weights one
float32 ulp apart, and move the logits by ~1e-7):

- :func:`softmax_route`: softmax over the experts, top-k, optionally
  group-limited (DeepSeek-V2's ``group_limited_greedy``: keep the
  ``topk_group`` groups with the best single score), optionally
  renormalized (``norm_topk_prob``), times ``routed_scaling_factor``
  (Qwen3-MoE, DeepSeek-V2).
- :func:`sigmoid_route`: DeepSeek-V3's sigmoid scores with a correction
  bias used only for choosing, group-limited by the sum of each group's two
  best scores.

Routed experts (SwiGLU, stacked weights ``gate_up`` [E, 2I, H] and ``down``
[E, H, I]) are summed exactly in one of two ways:

- :func:`experts_sparse`: one expert at a time over the rows routed to it.
  Least work, but the set of experts hit is read on the host (a sync), so a
  graph backend cannot capture it: the eager prefill path.
- :func:`experts_dense`: every expert over every row, weighted by a dense
  [T, E] routing matrix that is zero for unrouted experts. The same sum,
  ``E / k`` times the FLOPs, static shapes and no sync: the capturable
  decode path (decode batches are small).

:func:`moe_experts` picks one by ``impl`` ("auto": dense while
``torch.compile`` traces or a CUDA stream captures, sparse otherwise).

Example
-------
>>> import torch
>>> x, router = torch.randn(3, 8), torch.randn(4, 8)
>>> w, e = softmax_route(x, router, top_k=2, norm_topk_prob=True)
>>> gate_up, down = torch.randn(4, 10, 8), torch.randn(4, 8, 5)
>>> torch.allclose(experts_sparse(x, w, e, gate_up, down), experts_dense(x, w, e, gate_up, down), atol=1e-5)
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.ops.ref import acc_dtype

MOE_IMPLS = ("auto", "sparse", "dense")


def softmax_route(
    x: torch.Tensor,
    router: torch.Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    logits_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: top-k experts of ``softmax(x @ router^T)``, optionally group-limited.

    Arguments
    ---------
    x: [T, H]; router: [E, H].
    top_k: experts per token.
    norm_topk_prob: divide the k chosen probabilities by their sum.
    routed_scaling_factor: multiplies the final weights.
    n_group, topk_group: with ``topk_group < n_group`` only the ``topk_group``
        groups of ``E / n_group`` consecutive experts whose best probability
        is highest are eligible (unchosen experts score 0).
    logits_dtype: dtype of the router matmul (Qwen3-MoE: the activations'
        dtype; DeepSeek-V2: float32). The softmax is float32. For float64
        ``x`` both are float64 (a float64 run routes in float64).

    Returns
    -------
    (weights [T, k] float32 (float64 for float64 x), experts [T, k] int64).

    Example
    -------
    >>> x, router = torch.eye(4), torch.eye(4)
    >>> w, e = softmax_route(x, router, top_k=1, n_group=2, topk_group=1)
    >>> e[:, 0].tolist()
    [0, 1, 2, 3]
    """
    t, e = x.shape[0], router.shape[0]
    acc = acc_dtype(x)  # float32, or float64 for a float64 run
    if acc == torch.float64:
        logits_dtype = acc
    logits = F.linear(x.to(logits_dtype), router.to(logits_dtype))  # [T, E]
    probs = logits.softmax(dim=-1, dtype=acc)  # [T, E]
    if topk_group < n_group:
        best = probs.view(t, n_group, e // n_group).max(dim=-1).values  # [T, G]
        keep = torch.zeros_like(best).scatter(1, best.topk(topk_group, dim=-1).indices, 1.0)  # [T, G]
        keep = keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)  # [T, E]
        probs = probs.masked_fill(keep == 0, 0.0)
    weights, experts = probs.topk(top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, experts


def sigmoid_route(
    x: torch.Tensor,
    router: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 sigmoid router with group-limited top-k, in float32 (float64 for float64 x).

    x: [T, H]; router: [E, H]; bias: [E] (``e_score_correction_bias``, used
    only for choosing). Groups of ``E / n_group`` experts are ranked by the sum
    of their two best biased scores, the best ``topk_group`` groups are kept,
    and the ``top_k`` best experts inside them are chosen. Weights are the
    unbiased sigmoid scores, optionally normalized, times the scaling factor.
    Returns (weights [T, top_k] float32 (float64 for float64 x), experts [T, top_k] int64).

    >>> w, e = sigmoid_route(torch.eye(4), torch.eye(4), torch.zeros(4), top_k=1, n_group=1, topk_group=1,
    ...                      norm_topk_prob=True, routed_scaling_factor=2.0)
    >>> e[:, 0].tolist(), w[:, 0].tolist()
    ([0, 1, 2, 3], [2.0, 2.0, 2.0, 2.0])
    """
    t, e = x.shape[0], router.shape[0]
    acc = acc_dtype(x)  # float32, or float64 for a float64 run
    scores = F.linear(x.to(acc), router.to(acc)).sigmoid()  # [T, E]
    choice = scores + bias.to(acc)
    per_group = choice.view(t, n_group, e // n_group)  # [T, G, E/G]
    group_score = per_group.topk(min(2, e // n_group), dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep = keep.scatter(1, group_score.topk(topk_group, dim=-1).indices, True)
    keep = keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)  # [T, E]
    experts = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, experts


def experts_sparse(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Exact routed-expert sum, one expert at a time over the tokens routed to it (host sync: eager only).

    x: [T, H]; weights, experts: [T, k]; gate_up: [E, 2I, H]; down: [E, H, I].
    Returns [T, H] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t]),
    accumulated in ascending expert order. Each product is formed in the
    promoted dtype of the expert output and the weight, then cast to x's
    dtype (as the reference does).

    >>> x = torch.randn(2, 4)
    >>> experts_sparse(x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), torch.randn(1, 6, 4),
    ...                torch.randn(1, 4, 3)).shape
    torch.Size([2, 4])
    """
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        tok, slot = torch.nonzero(experts == e, as_tuple=True)  # tokens routed to e
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, down[e]) * weights[tok, slot, None]  # [n, H]
        out.index_add_(0, tok, y.to(x.dtype))
    return out


def experts_dense(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The routed-expert sum of :func:`experts_sparse` with every expert on every row (no sync, static shapes).

    The k routing weights are scattered into a dense ``route`` [T, E] (zero
    where a token is not routed), then::

        a[e, t]  = silu(x[t] @ gate[e]^T) * (x[t] @ up[e]^T)     # [E, T, I]
        out[t]   = sum_e route[t, e] * (a[e, t] @ down[e]^T)      # [T, H]

    as one contraction over (e, i), in x's dtype (weights are cast to it:
    no float32 copy of the expert weights). Mathematically the sparse sum
    (unrouted experts get weight 0); the summation order differs, so results
    agree to rounding. x: [T, H]; weights, experts: [T, k]; gate_up: [E, 2I, H];
    down: [E, H, I]. Returns [T, H].

    >>> x = torch.randn(2, 4)
    >>> experts_dense(x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), torch.randn(3, 6, 4),
    ...               torch.randn(3, 4, 3)).shape
    torch.Size([2, 4])
    """
    t, e = x.shape[0], gate_up.shape[0]
    route = torch.zeros(t, e, dtype=x.dtype, device=x.device).scatter(1, experts, weights.to(x.dtype))  # [T, E]
    gate, up = torch.einsum("th,efh->etf", x, gate_up).chunk(2, dim=-1)  # [E, T, I] each
    act = F.silu(gate) * up * route.t()[:, :, None]  # [E, T, I]: the routing weight folded in
    return torch.einsum("eti,ehi->th", act, down)  # [T, H]


def use_dense(impl: str) -> bool:
    """Whether :func:`moe_experts` takes the dense path for ``impl`` ("auto", "sparse" or "dense").

    "auto" is dense exactly while a graph is being built: ``torch.compile``
    tracing, or a CUDA stream capture. Other graph builders (NPU graphs)
    must ask for "dense" through the family config's ``moe_impl``.

    >>> use_dense("auto"), use_dense("dense")
    (False, True)
    """
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}; got {impl!r}")
    if impl != "auto":
        return impl == "dense"
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """The routed-expert sum, sparse or dense as :func:`use_dense` decides. Shapes as :func:`experts_sparse`.

    >>> x = torch.randn(2, 4)
    >>> moe_experts(x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), torch.randn(1, 6, 4),
    ...             torch.randn(1, 4, 3), impl="dense").shape
    torch.Size([2, 4])
    """
    run = experts_dense if use_dense(impl) else experts_sparse
    return run(x, weights, experts, gate_up, down)
