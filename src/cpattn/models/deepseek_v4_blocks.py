"""DeepSeek-V4's building blocks outside the attention kernels, as pure functions.

Numerics follow the Hugging Face model (the oracle): norms, hyper-connection
weights and RoPE in float32 (float64 when the activations are float64).

- :func:`rms_norm` / :func:`rms_norm_unweighted` -- V4 multiplies the float32
  weight before casting back; the query's per-head norm has no weight.
- :func:`rope_tail` -- interleaved RoPE (pairs ``2i, 2i+1``) on the last
  ``rope_dim`` channels, layout kept (the output projection reads it);
  with ``-sin`` it is the inverse rotation V4 applies to the attention output.
- :func:`hyper_weights`, :func:`hyper_mix`, :func:`hyper_head` --
  manifold-constrained hyper-connections: ``n_hc`` residual streams, a
  layer reads their ``pre``-weighted sum, writes its output back with
  ``post`` weights, and the streams mix through ``comb``, made doubly
  stochastic by Sinkhorn-Knopp iterations.
- :func:`route` (``sqrtsoftplus`` or ``sigmoid`` scores, top-k on
  ``score + bias``, or a fixed ``tid2eid[token]`` table in the first
  "hash" layers), :func:`experts` and :func:`mlp` -- the MoE, whose gate /
  up pre-activations are clamped at ``swiglu_limit``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.models.moe import use_dense
from cpattn.ops.ref import acc_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """V4's RMSNorm over the last dim: ``(weight * normalize(x)).to(x.dtype)``, in float32.

    >>> rms_norm(torch.full((1, 4), 3.0), torch.ones(4), 0.0).tolist()
    [[1.0, 1.0, 1.0, 1.0]]
    """
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(acc) * xf).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (V4's query norm, per head; the hyper-connection input norm).

    >>> rms_norm_unweighted(torch.full((2,), 2.0), 0.0).tolist()
    [1.0, 1.0]
    """
    return x * torch.rsqrt(x.to(acc_dtype(x.dtype)).square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the last ``2 * cos.shape[-1]`` channels of x [T, H, D]; cos, sin: [T, r/2].

    Pair i is channels ``(D - r + 2i, D - r + 2i + 1)``, rotated by angle i in
    place; the leading ``D - r`` channels pass through. Pass ``-sin`` to undo it.

    >>> x = torch.tensor([[[5.0, 1.0, 0.0]]])
    >>> rope_tail(x, torch.zeros(1, 1), torch.ones(1, 1)).tolist()  # a quarter turn of (1, 0)
    [[[5.0, 0.0, 1.0]]]
    """
    r = 2 * cos.shape[-1]
    acc = acc_dtype(x.dtype)
    c, s = cos.to(acc)[:, None, :], sin.to(acc)[:, None, :]  # [T, 1, r/2]
    tail = x[..., x.shape[-1] - r:].to(acc)
    even, odd = tail[..., 0::2], tail[..., 1::2]  # [T, H, r/2]
    rot = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)  # [T, H, r]
    return torch.cat([x[..., : x.shape[-1] - r], rot.to(x.dtype)], dim=-1)


def hyper_weights(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
    sinkhorn_iters: int, hc_eps: float, rms_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One hyper-connection's weights from the streams [T, n, H].

    fn: [(2 + n) n, n H]; base: [(2 + n) n]; scale: [3]. Returns post [T, n],
    comb [T, n, n] (doubly stochastic) and the collapsed layer input [T, H]
    ``sum_j pre[t, j] streams[t, j]``.
    """
    t, n, h = streams.shape
    acc = acc_dtype(streams.dtype)
    flat = rms_norm_unweighted(streams.reshape(t, n * h).to(acc), rms_eps)  # t may be 0 (an empty PCP rank)
    mix = F.linear(flat, fn.to(acc))  # [T, (2 + n) n]
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    base, scale = base.to(acc), scale.to(acc)
    pre = torch.sigmoid(pre_w * scale[0] + base[:n]) + hc_eps  # [T, n]
    post = 2 * torch.sigmoid(post_w * scale[1] + base[n : 2 * n])  # [T, n]
    comb = torch.softmax(comb_w.view(t, n, n) * scale[2] + base[2 * n :].view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)  # [T, H]
    return post, comb, collapsed


def hyper_mix(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, H]: ``post[k] * out + sum_j comb[j, k] * streams[j]`` (comb read transposed)."""
    dt = streams.dtype
    return post.to(dt)[..., None] * out[:, None, :] + torch.einsum("tjk,tjh->tkh", comb.to(dt), streams)


def hyper_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
               hc_eps: float, rms_eps: float) -> torch.Tensor:
    """The final collapse of the streams [T, n, H] -> [T, H] (before the last RMSNorm)."""
    acc = acc_dtype(streams.dtype)
    flat = rms_norm_unweighted(streams.flatten(1).to(acc), rms_eps)
    pre = torch.sigmoid(F.linear(flat, fn.to(acc)) * scale.to(acc) + base.to(acc)) + hc_eps  # [T, n]
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
          tokens: torch.Tensor, *, top_k: int, scoring: str, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert choice and weights: (weights [T, k], experts [T, k]).

    scores = sqrtsoftplus(x W^T) (or sigmoid); experts = top-k of ``scores +
    bias``, or ``tid2eid[tokens]`` in a hash layer; weights = the chosen
    scores normalised to sum 1, times ``scaling``.
    """
    logits = F.linear(x, weight)  # [T, E]
    if scoring == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"scoring_func {scoring!r} is not supported; supported: 'sqrtsoftplus', 'sigmoid'")
    if tid2eid is not None:
        experts = tid2eid[tokens].long()  # [T, k] fixed by the token id
    else:
        experts = torch.topk(scores + bias, top_k, dim=-1).indices
    w = scores.gather(1, experts)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling, experts


def _swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, limit: float) -> torch.Tensor:
    """Routed experts, exactly: x [T, H] -> [T, H]; one expert at a time over its rows (eager), or every
    expert over every row while a graph is built (:func:`experts_dense`: no host sync, static shapes).

    gate_up: [E, 2I, H] (gate rows first); down: [E, H, I]. A token routed
    twice to one expert (possible in hash layers) gets both contributions.
    """
    if use_dense("auto"):
        return experts_dense(x, weights, chosen, gate_up, down, limit)
    out = torch.zeros_like(x)
    for e in torch.unique(chosen).tolist():
        tok, slot = torch.nonzero(chosen == e, as_tuple=True)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(_swiglu_clamped(gate, up, limit), down[e]) * weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def experts_dense(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, limit: float) -> torch.Tensor:
    """:func:`experts` with every expert on every row, weighted by a dense [T, E] routing matrix (zero where
    a token is not routed; a token routed twice to one expert gets the sum). The same sum in another
    order: equal to rounding.

    >>> x, w, e = torch.randn(3, 4), torch.rand(3, 2), torch.tensor([[0, 0], [1, 2], [2, 0]])
    >>> gu, dn = torch.randn(3, 6, 4), torch.randn(3, 4, 3)
    >>> torch.allclose(experts_dense(x, w, e, gu, dn, 10.0), experts(x, w, e, gu, dn, 10.0), atol=1e-5)
    True
    """
    route = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    route = route.scatter_add(1, chosen, weights.to(x.dtype))  # [T, E]
    gate, up = torch.einsum("th,efh->etf", x, gate_up).chunk(2, dim=-1)  # [E, T, I] each
    act = _swiglu_clamped(gate, up, limit) * route.t()[:, :, None]  # [E, T, I]
    return torch.einsum("eti,ehi->th", act, down)  # [T, H]


def mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, limit: float) -> torch.Tensor:
    """The shared expert: clamped SwiGLU. x [T, H] -> [T, H].

    >>> mlp(torch.zeros(2, 4), torch.ones(3, 4), torch.ones(3, 4), torch.ones(4, 3), 10.0).abs().sum().item()
    0.0
    """
    return F.linear(_swiglu_clamped(F.linear(x, gate), F.linear(x, up), limit), down)
