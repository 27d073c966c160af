"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) and its short causal convolution, as ops.

The gated delta rule, per value head and token t (DESIGN.md §4.13)::

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T      S: [d_k, d_v]
    o_t = S_t^T q_t

with ``a_t = exp(g_t)`` (decay, ``g <= 0``), ``b_t = beta_t`` in (0, 1),
q and k optionally L2-normalised (``x * rsqrt(sum x^2 + 1e-6)``, as FLA and
transformers do) and q scaled by ``scale`` (the models: ``d_k ** -0.5``).
Key heads may be fewer than value heads: key head ``h // (Hv // Hk)``
serves value head h. The model computes ``g = -exp(A_log) *
softplus(a + dt_bias)`` and ``beta = sigmoid(b)``; these ops take g and beta.

Ops (``torch.ops.cpattn.*``, public wrappers below):

- :func:`gated_delta_chunk` (prefill): packed varlen tokens ``[T, H, D]``
  with ``cu_seqlens``, each request from its ``initial_state``; the chunked
  (WY / UT-transform) form, chunks of ``chunk_size`` tokens, then a scan
  over chunks. Returns the outputs and each request's final state.
- :func:`gated_delta_step` (decode): one token per request updating its
  state; plain torch without host syncs (one body for every device, the
  CPU decomposition, capturable).
- :func:`causal_conv1d`: the depthwise causal convolution (kernel K, 4 in
  the models) over packed tokens, each request continuing from its conv
  state (its last ``K - 1`` inputs), optionally followed by SiLU. Decode is
  the same op with one token per request. Plain torch, no host syncs.

Numerics: float32 (float64 for float64 inputs); states are returned in that
dtype, outputs in q's (x's) dtype. NaN from the data reaches exactly the
outputs it reaches in the sequential recurrence: the chunked form masks with
``where`` (never multiplies a hidden entry by 0) and sets the intra-chunk
output of a row to NaN when a value row at or before it is non-finite. The
float64 sequential oracle is :mod:`cpattn.ops.gated_delta_ref`.

Example
-------
>>> import torch
>>> from cpattn.ops.gated_delta import gated_delta_chunk
>>> q, k, v = torch.randn(5, 2, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 3)
>>> g, beta = -torch.rand(5, 2), torch.rand(5, 2)
>>> o, s = gated_delta_chunk(q, k, v, g, beta, torch.tensor([0, 2, 5]), torch.zeros(2, 2, 4, 3), scale=0.5)
>>> o.shape, s.shape
(torch.Size([5, 2, 3]), torch.Size([2, 2, 4, 3]))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.ops import checks, registry
from cpattn.ops import gated_delta_chunks as chunks
from cpattn.ops.ref import acc_dtype

CHUNK_SIZE = 64  # tokens per chunk of the chunked form (FLA's and transformers' default)
L2_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` (FLA's and transformers' form).

    >>> l2norm(torch.tensor([3.0, 4.0]), eps=0.0).tolist()
    [0.6000000238418579, 0.800000011920929]
    """
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool,
               acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> [..., Hv, Dk] in ``acc``: L2-normalised (when asked), q scaled, heads repeated."""
    q, k = q.to(acc), k.to(acc)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    rep = num_v_heads // k.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k


def chunk_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request in the chunked form, all heads at once (tensors already prepared, in one float dtype).

    q, k: [H, L, Dk]; v: [H, L, Dv]; g, beta: [H, L]; state: [H, Dk, Dv].
    Returns o [H, L, Dv] and the state after the L tokens [H, Dk, Dv] (see :mod:`cpattn.ops.gated_delta_chunks`).
    """
    return chunks.run(q, k, v, g, beta, state, chunk_size)


def chunk_varlen(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, chunk_size):
    """The chunked op's body: a host loop over the requests of ``cu_seqlens`` (see :func:`gated_delta_chunk`)."""
    acc = acc_dtype(q, initial_state)
    t, hv, dv = v.shape
    cu = cu_seqlens.tolist()
    checks.cumulative("cu_seqlens", cu, total=t, of=f"q has {t} tokens", exact=True)
    qq, kk = prepare_qk(q, k, hv, scale, use_qk_l2norm, acc)  # [T, Hv, Dk]
    vv, gg, bb = v.to(acc), g.to(acc), beta.to(acc)
    out = torch.empty(t, hv, dv, dtype=acc, device=q.device)
    states = []
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        o, s = chunk_request(qq[lo:hi].transpose(0, 1), kk[lo:hi].transpose(0, 1), vv[lo:hi].transpose(0, 1),
                             gg[lo:hi].transpose(0, 1), bb[lo:hi].transpose(0, 1), initial_state[b].to(acc),
                             chunk_size)
        out[lo:hi] = o.transpose(0, 1)
        states.append(s)
    final = torch.stack(states) if states else initial_state.to(acc).clone()
    return out.to(q.dtype), final


@registry.define("gated_delta_chunk")
def _gated_delta_chunk_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, initial_state: torch.Tensor, scale: float, use_qk_l2norm: bool, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    raise registry.no_kernel("gated_delta_chunk", q)


@registry.fake("gated_delta_chunk")
def _gated_delta_chunk_fake(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, chunk_size):
    return q.new_empty(v.shape), initial_state.new_empty(initial_state.shape, dtype=acc_dtype(q, initial_state))


registry.kernel("gated_delta_chunk", "cpu")(chunk_varlen)
if torch.cuda.is_available():  # pragma: no cover - needs a GPU
    registry.kernel("gated_delta_chunk", "cuda")(chunk_varlen)


def step_body(q, k, v, g, beta, state, scale, use_qk_l2norm):
    """The decode op's math (plain torch, no host sync): see :func:`gated_delta_step`."""
    acc = acc_dtype(q, state)
    qq, kk = prepare_qk(q, k, v.shape[1], scale, use_qk_l2norm, acc)  # [B, Hv, Dk]
    s = state.to(acc) * g.to(acc).exp()[..., None, None]  # [B, Hv, Dk, Dv]
    pred = torch.einsum("bhkv,bhk->bhv", s, kk)  # what the decayed state predicts for k
    delta = (v.to(acc) - pred) * beta.to(acc)[..., None]  # [B, Hv, Dv]
    s = s + kk[..., :, None] * delta[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", s, qq)
    return o.to(q.dtype), s


@registry.define("gated_delta_step")
def _gated_delta_step_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    scale: float, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return step_body(q, k, v, g, beta, state, scale, use_qk_l2norm)


registry.generic("gated_delta_step")


@registry.fake("gated_delta_step")
def _gated_delta_step_fake(q, k, v, g, beta, state, scale, use_qk_l2norm):
    return q.new_empty(v.shape), state.new_empty(state.shape, dtype=acc_dtype(q, state))


def conv_body(x, weight, bias, cu_seqlens, conv_state, silu):
    """The conv op's math (plain torch, no host sync): see :func:`causal_conv1d`.

    Every token by K shifted slices of the packed tokens (as if one request), then the first K-1 tokens of
    each request (a fixed [B, K-1] set) recomputed from its conv state and written over them."""
    acc = acc_dtype(x, weight)
    t, c = x.shape
    kw, nb = weight.shape[1], conv_state.shape[0]
    w = kw - 1
    cu = cu_seqlens.to(torch.int64)
    wt = weight.to(acc)
    xs = x.to(conv_state.dtype)
    xa = xs.to(acc)
    y = torch.zeros(t + 1, c, dtype=acc, device=x.device)  # the last row takes the fix-up's dead writes
    if bias is not None:
        y += bias.to(acc)
    for j in range(kw):  # tap j reads the input ``w - j`` tokens back
        sh = w - j
        if sh < t:
            y[sh:t].addcmul_(xa[:t - sh], wt[:, j])
    req = torch.arange(nb, device=x.device)[:, None]
    i = torch.arange(w, device=x.device)
    tok = cu[:-1, None] + i  # [B, W]: each request's first W tokens
    lens = (cu[1:] - cu[:-1])[:, None]
    live = i < lens
    fix = torch.zeros(nb, w, c, dtype=acc, device=x.device) if bias is None else bias.to(acc).expand(nb, w, c)
    for j in range(kw):  # ... from the conv state when that is before the request
        p = i + j - w  # [W]: position read, in the request
        xrow = x.new_empty(nb, w, c, dtype=xs.dtype) if t == 0 else xs[torch.where(live & (p >= 0), tok + j - w, 0)]
        val = torch.where((p >= 0)[:, None], xrow, conv_state[:, (w + p).clamp(max=w - 1)])
        fix = fix + val.to(acc) * wt[:, j]
    y.index_put_((torch.where(live, tok, t).flatten(),), fix.flatten(0, 1))
    y = y[:t]
    if silu:
        y = F.silu(y)
    e = lens + i  # [B, W]: the last W rows of (state | tokens)
    xrow = x.new_empty(nb, w, c, dtype=xs.dtype) if t == 0 else xs[torch.where(e >= w, cu[:-1, None] + e - w, 0)]
    state = torch.where((e < w)[..., None], conv_state[req, e.clamp(max=w - 1)], xrow)
    return y.to(x.dtype), state


@registry.define("causal_conv1d")
def _causal_conv1d_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor, silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return conv_body(x, weight, bias, cu_seqlens, conv_state, silu)


registry.generic("causal_conv1d")


@registry.fake("causal_conv1d")
def _causal_conv1d_fake(x, weight, bias, cu_seqlens, conv_state, silu):
    return x.new_empty(x.shape), conv_state.new_empty(conv_state.shape)


# ----------------------------------------------------------------------------- public wrappers
def _check_qkv(q, k, v, g, beta, lead: str) -> None:
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            raise ValueError(f"{name} must be a floating tensor; got {type(x).__name__} {getattr(x, 'dtype', '')}")
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must be [{lead}, Hk, Dk] alike; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    n, hk, _ = q.shape
    if v.dim() != 3 or v.shape[0] != n or v.shape[1] % hk:
        raise ValueError(f"v must be [{lead}={n}, Hv, Dv] with Hv a multiple of Hk={hk}; got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != tuple(v.shape[:2]):
            raise ValueError(f"{name} must be [{lead}, Hv] = {tuple(v.shape[:2])}; got {tuple(x.shape)}")


def _check_state(name: str, state: torch.Tensor, batch: int, q: torch.Tensor, v: torch.Tensor) -> None:
    want = (batch, v.shape[1], q.shape[2], v.shape[2])
    if not isinstance(state, torch.Tensor) or tuple(state.shape) != want:
        got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(f"{name} must be [B, Hv, Dk, Dv] = {want}; got {got} (pass zeros for a fresh request)")


def gated_delta_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, initial_state: torch.Tensor, *, scale: float, use_qk_l2norm: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over packed prefill tokens, chunked (see the module doc).

    Arguments
    ---------
    q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (``Hv % Hk == 0``); g, beta: [T, Hv]
        (log decay ``<= 0`` and write strength).
    cu_seqlens: [B+1] int, request b's tokens are ``cu[b]:cu[b+1]`` (from 0 to T).
    initial_state: [B, Hv, Dk, Dv], each request's state before its tokens
        (zeros for a fresh request, the cached state for a continuation).
    scale: multiplies q (after the L2 norm); the models pass ``Dk ** -0.5``.
    use_qk_l2norm: L2-normalise q and k first (the models do).
    chunk_size: tokens per chunk of the chunked form (results do not depend on it beyond rounding).

    Returns
    -------
    o: [T, Hv, Dv] in q's dtype; final_state: [B, Hv, Dk, Dv] in float32
    (float64 for float64 inputs).

    Example
    -------
    >>> import torch
    >>> q = k = torch.tensor([[[1.0, 0.0]]]); v = torch.tensor([[[2.0]]])
    >>> o, s = gated_delta_chunk(q, k, v, torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([0, 1]),
    ...                          torch.zeros(1, 1, 2, 1), scale=1.0, use_qk_l2norm=False)
    >>> o.flatten().tolist(), s.flatten().tolist()
    ([2.0], [2.0, 0.0])
    """
    _check_qkv(q, k, v, g, beta, "T")
    checks.cu_seqlens("cu_seqlens", cu_seqlens, total=q.shape[0], of=f"q has {q.shape[0]} tokens", exact=True)
    _check_state("initial_state", initial_state, cu_seqlens.numel() - 1, q, v)
    checks.same_device("q", q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state)
    chunk_size = checks.integer("chunk_size", chunk_size, at_least=1)
    return registry.call("gated_delta_chunk", q, k, v, g, beta, cu_seqlens, initial_state, float(scale),
                         bool(use_qk_l2norm), chunk_size)


def gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per request through the gated delta rule (the recurrent form).

    q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dk, Dv].
    Returns (o [B, Hv, Dv] in q's dtype, the new state [B, Hv, Dk, Dv] in
    float32 / float64). Functional: ``state`` is not modified.

    >>> import torch
    >>> q = k = torch.tensor([[[1.0, 0.0]]]); v = torch.tensor([[[2.0]]])
    >>> o, s = gated_delta_step(q, k, v, torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1, 1, 2, 1), scale=1.0,
    ...                         use_qk_l2norm=False)
    >>> o.flatten().tolist()
    [2.0]
    """
    _check_qkv(q, k, v, g, beta, "B")
    _check_state("state", state, q.shape[0], q, v)
    checks.same_device("q", q, k=k, v=v, g=g, beta=beta, state=state)
    return registry.call("gated_delta_step", q, k, v, g, beta, state, float(scale), bool(use_qk_l2norm))


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor, *, silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over packed tokens, continuing each request's conv state.

    ``y[t, c] = bias[c] + sum_j weight[c, j] * x[t - (K-1) + j, c]``, where
    inputs before a request's first token come from its ``conv_state``
    (zeros for a fresh request), then SiLU when ``silu``.

    Arguments
    ---------
    x: [T, C]; weight: [C, K] (transformers' ``conv1d.weight`` [C, 1, K]
        squeezed); bias: [C] or None; cu_seqlens: [B+1] int;
    conv_state: [B, K-1, C], each request's last K-1 inputs before this step.

    Returns
    -------
    y: [T, C] in x's dtype (computed in float32 / float64); the new conv
    state [B, K-1, C] (the last K-1 inputs of state and tokens), conv_state's dtype.

    Example
    -------
    >>> import torch
    >>> y, s = causal_conv1d(torch.arange(1.0, 4.0)[:, None], torch.ones(1, 2), None, torch.tensor([0, 3]),
    ...                      torch.full((1, 1, 1), 10.0), silu=False)
    >>> y.flatten().tolist(), s.flatten().tolist()
    ([11.0, 3.0, 5.0], [3.0])
    """
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_floating_point()):
        raise ValueError(f"x must be a floating [T, C] tensor; got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    t, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 2:
        raise ValueError(f"weight must be [C={c}, K] with K >= 2; got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"bias must be [C={c}] or None; got {tuple(bias.shape)}")
    checks.cu_seqlens("cu_seqlens", cu_seqlens, total=t, of=f"x has {t} tokens", exact=True)
    want = (cu_seqlens.numel() - 1, weight.shape[1] - 1, c)
    if tuple(conv_state.shape) != want:
        raise ValueError(f"conv_state must be [B, K-1, C] = {want}; got {tuple(conv_state.shape)} "
                         "(pass zeros for a fresh request)")
    checks.same_device("x", x, weight=weight, bias=bias, cu_seqlens=cu_seqlens, conv_state=conv_state)
    return registry.call("causal_conv1d", x, weight, bias, cu_seqlens, conv_state, bool(silu))
