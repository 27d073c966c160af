"""``mla_preprocess`` (MLAPO): the MLA decode preprocessing chain as one registry op.

From a layer's input hidden states to the absorbed query and the written
latent cache, in the order the models compute it (DeepSeek-V2/V3/V3.2,
GLM-5; :func:`cpattn.models.deepseek_v3.mla_project` then
:func:`cpattn.ops.write_kv_mla`)::

    x      = RMSNorm(hidden) * input_norm_weight                  # [T, H]
    q_lora = RMSNorm(x @ q_a^T) * q_a_norm                        # [T, Rq]   (q LoRA)
    q      = q_lora @ q_b^T          (or x @ q_proj^T without LoRA)  # [T, Hq, nope + rope]
    q_lat  = q_nope @ W_UK[h]        per head h                     # [T, Hq, r]
    ckv    = x @ kv_a^T                                           # [T, r + rope]
    c      = RMSNorm(ckv[:, :r]) * kv_a_norm                      # [T, r]
    q_rope, k_rope = RoPE(q[..., nope:]), RoPE(ckv[:, r:])        # interleaved or half-split
    kv_cache[slot_mapping[t]] = [c | k_rope][t]   for slot != -1    # one latent row per token

RMSNorm normalizes in float32 and casts back (as the models do). RoPE
output is laid out half-split (``[rotated a | rotated b]`` of each pair);
with ``rope_interleave`` the pairs are dims ``(2i, 2i+1)`` (DeepSeek),
otherwise ``(i, i + rope/2)``; queries and keys get the same layout, so
scores are unchanged. A slot of -1 writes nothing (a token another DCP rank
owns, or a padding row).

Outputs, all new tensors in the hidden dtype:

- ``q`` [T, Hq, r + rope]: ``[q_lat | q_rope]``, the absorbed query the
  latent attention reads;
- ``kv`` [T, 1, r + rope]: the rows written (prefill and PCP hand the new
  rows on without reading the cache back);
- ``q_lora`` [T, Rq] (``[T, 0]`` without q LoRA): the normalized query latent
  the DSA indexer reads (DeepSeek-V3.2, GLM-5);
- ``x`` [T, H]: the normed hidden state (the DSA indexer's key and weight input).

Implementations: the CPU kernel (host-indexed cache write) and a
device-generic body (sync-free write, see :func:`cpattn.ops.rows.scatter_rows`)
that is also the op's CPU decomposition under torch.compile; the float64
oracle the tests use is ``tests/ref/mlapo.py``; an Ascend kernel on
``torch_npu.npu_mla_prolog_v3`` is in :mod:`cpattn.ops.mla_preprocess_npu`
(untested on hardware).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from cpattn.ops import checks, registry
from cpattn.ops.norm_rope import rms_norm, rope_half, rope_interleaved
from cpattn.ops.rows import scatter_rows


class MLAPreprocessOut(NamedTuple):
    """What :func:`mla_preprocess` returns (see the module docstring)."""

    q: torch.Tensor  # [T, Hq, r + rope]
    kv: torch.Tensor  # [T, 1, r + rope]
    q_lora: torch.Tensor  # [T, Rq] or [T, 0]
    x: torch.Tensor  # [T, H]


def mla_chain(hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_a_norm_weight,
             w_uk, cos, sin, eps, rope_interleave, latent_eps):
    """The preprocessing chain without the cache write: (q, kv, q_lora, x) of :class:`MLAPreprocessOut`.

    The models' unfused path (:func:`cpattn.models.deepseek_v3.mla_project`)
    runs this same code, so fused and unfused round identically. Arguments
    as :func:`mla_preprocess` (positional, no checks).
    """
    t, (hq, nope, r) = hidden.shape[0], w_uk.shape
    x = hidden if input_norm_weight is None else rms_norm(hidden, input_norm_weight, eps)  # [T, H]
    if q_a_weight is None:
        q_lora = x.new_empty(t, 0)
        q = F.linear(x, q_b_weight)
    else:
        q_lora = rms_norm(F.linear(x, q_a_weight), q_a_norm_weight, latent_eps)  # [T, Rq]
        q = F.linear(q_lora, q_b_weight)
    q = q.view(t, hq, nope + 2 * cos.shape[-1])  # [T, Hq, nope + rope]
    ckv = F.linear(x, kv_a_weight)  # [T, r + rope]
    c = rms_norm(ckv[:, :r], kv_a_norm_weight, latent_eps)  # [T, r]
    # RoPE in the tables' dtype (float32 or wider where the model rotates wider), cast back
    rot = rope_interleaved if rope_interleave else rope_half
    q_rope = rot(q[..., nope:].to(cos.dtype), cos, sin).to(q.dtype)  # [T, Hq, rope]
    k_rope = rot(ckv[:, None, r:].to(cos.dtype), cos, sin).to(ckv.dtype)  # [T, 1, rope]
    q_lat = torch.einsum("thn,hnr->thr", q[..., :nope], w_uk)  # [T, Hq, r]
    q_full = torch.cat([q_lat, q_rope], dim=-1)  # [T, Hq, r + rope]
    kv = torch.cat([c[:, None], k_rope], dim=-1)  # [T, 1, r + rope]
    return q_full, kv, q_lora, x


@registry.define("mla_preprocess", mutates_args=("kv_cache",))
def _mla_preprocess_op(
    hidden: torch.Tensor,
    input_norm_weight: torch.Tensor | None,
    q_a_weight: torch.Tensor | None,
    q_a_norm_weight: torch.Tensor | None,
    q_b_weight: torch.Tensor,
    kv_a_weight: torch.Tensor,
    kv_a_norm_weight: torch.Tensor,
    w_uk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    eps: float,
    rope_interleave: bool,
    latent_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, kv, q_lora, x = mla_chain(hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight,
                              kv_a_norm_weight, w_uk, cos, sin, eps, rope_interleave, latent_eps)
    scatter_rows(kv_cache.view(-1, *kv_cache.shape[2:]), kv, slot_mapping)  # sync-free; slot -1 writes nothing
    return q, kv, q_lora, (x if input_norm_weight is not None else x.clone())  # an op's output may not alias an input


registry.generic("mla_preprocess")  # the body above: any device, and the CPU decomposition for graphs


@registry.kernel("mla_preprocess", "cpu")
def _mla_preprocess_cpu(hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight,
                        kv_a_norm_weight, w_uk, cos, sin, kv_cache, slot_mapping, eps, rope_interleave, latent_eps):
    q, kv, q_lora, x = mla_chain(hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight,
                              kv_a_norm_weight, w_uk, cos, sin, eps, rope_interleave, latent_eps)
    rows = (slot_mapping >= 0).nonzero().view(-1)  # host-side selection: fine inside a CPU kernel
    kv_cache.view(-1, *kv_cache.shape[2:]).index_copy_(0, slot_mapping[rows].long(), kv[rows].to(kv_cache.dtype))
    return q, kv, q_lora, (x if input_norm_weight is not None else x.clone())  # an op's output may not alias an input


@registry.fake("mla_preprocess")
def _mla_preprocess_fake(hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight,
                         kv_a_norm_weight, w_uk, cos, sin, kv_cache, slot_mapping, eps, rope_interleave, latent_eps):
    t, (hq, _, r) = hidden.shape[0], w_uk.shape
    d = r + 2 * cos.shape[-1]
    rq = 0 if q_a_weight is None else q_a_weight.shape[0]
    return (hidden.new_empty(t, hq, d), hidden.new_empty(t, 1, d), hidden.new_empty(t, rq),
            hidden.new_empty(t, hidden.shape[1]))


def _shape(name: str, t: torch.Tensor, want: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be {what} = {tuple(want)}; got {tuple(t.shape)}")


def mla_preprocess(
    hidden: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    input_norm_weight: torch.Tensor | None,
    q_a_weight: torch.Tensor | None,
    q_a_norm_weight: torch.Tensor | None,
    q_b_weight: torch.Tensor,
    kv_a_weight: torch.Tensor,
    kv_a_norm_weight: torch.Tensor,
    w_uk: torch.Tensor,
    eps: float,
    rope_interleave: bool,
    latent_eps: float | None = None,
) -> MLAPreprocessOut:
    """MLA preprocessing of one layer for T tokens, writing their latent rows into a paged cache.

    Arguments
    ---------
    hidden: [T, H] the layer's input (before ``input_layernorm``).
    kv_cache: [num_blocks, block_size, 1, r + rope] latent cache, contiguous,
        written in place (cast to its dtype).
    slot_mapping: [T] int32/int64, ``block * block_size + offset`` or -1 (not
        written: a token another DCP rank owns, a padding row). Valid slots
        distinct and inside the cache (a ValueError names the first that is
        not; not checked while tracing or capturing).
    cos, sin: [T, rope/2] RoPE tables at the tokens' positions, in the hidden
        dtype or wider (the rope dims rotate in the tables' dtype, then cast back).
    input_norm_weight: [H] (``input_layernorm.weight``), or None when ``hidden``
        is already normed (a decoder trunk that applies ``input_layernorm`` itself).
    q_a_weight: [Rq, H] (``q_a_proj.weight``) and q_a_norm_weight: [Rq]
        (``q_a_layernorm.weight``), or both None for a model without q LoRA.
    q_b_weight: [Hq * (nope + rope), Rq] (``q_b_proj.weight``), or
        [Hq * (nope + rope), H] (``q_proj.weight``) without q LoRA.
    kv_a_weight: [r + rope, H] (``kv_a_proj_with_mqa.weight``);
        kv_a_norm_weight: [r] (``kv_a_layernorm.weight``).
    w_uk: [Hq, nope, r], the key half of ``kv_b_proj.weight``:
        ``kv_b.view(Hq, nope + v_head_dim, r)[:, :nope]`` (:func:`mla_weights`).
    eps: the input RMSNorm's epsilon; latent_eps: the q / kv latent norms'
        (default ``eps``; the DeepSeek and GLM-5 models use 1e-6 there whatever
        ``rms_norm_eps`` says); rope_interleave: pairs (2i, 2i+1) (True, DeepSeek)
        or (i, i + rope/2).

    Every weight must have the hidden dtype; every tensor the hidden device.

    Returns
    -------
    MLAPreprocessOut(q [T, Hq, r + rope], kv [T, 1, r + rope], q_lora [T, Rq] or [T, 0], x [T, H]).

    Example
    -------
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> T, H, Hq, nope, rope, r, Rq = 3, 16, 2, 8, 4, 12, 10
    >>> w = lambda *s: torch.randn(*s, generator=g) * 0.1
    >>> cache = torch.full((2, 4, 1, r + rope), float("nan"))
    >>> out = mla_preprocess(
    ...     w(T, H), cache, torch.tensor([5, -1, 0]), torch.ones(T, rope // 2), torch.zeros(T, rope // 2),
    ...     input_norm_weight=torch.ones(H), q_a_weight=w(Rq, H), q_a_norm_weight=torch.ones(Rq),
    ...     q_b_weight=w(Hq * (nope + rope), Rq), kv_a_weight=w(r + rope, H), kv_a_norm_weight=torch.ones(r),
    ...     w_uk=w(Hq, nope, r), eps=1e-6, rope_interleave=True)
    >>> out.q.shape, out.kv.shape, out.q_lora.shape
    (torch.Size([3, 2, 16]), torch.Size([3, 1, 16]), torch.Size([3, 10]))
    >>> torch.equal(cache[1, 1, 0], out.kv[0, 0]), bool(cache[0, 1:].isnan().all())
    (True, True)
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H]; got shape {tuple(hidden.shape)}")
    t, h = hidden.shape
    if w_uk.dim() != 3:
        raise ValueError(f"w_uk must be [Hq, nope, r]; got shape {tuple(w_uk.shape)}")
    hq, nope, r = w_uk.shape
    if cos.dim() != 2 or cos.shape[0] != t or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [T={t}, rope/2]; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rope = 2 * cos.shape[1]
    if kv_cache.dim() != 4 or kv_cache.shape[2:] != (1, r + rope) or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache must be a contiguous [num_blocks, block_size, 1, r + rope = {r + rope}] latent cache; "
            f"got {tuple(kv_cache.shape)}{'' if kv_cache.is_contiguous() else ' (not contiguous)'}"
        )
    if (q_a_weight is None) != (q_a_norm_weight is None):
        raise ValueError("q_a_weight and q_a_norm_weight go together: pass both (q LoRA) or neither (q_proj)")
    if input_norm_weight is not None:
        _shape("input_norm_weight", input_norm_weight, (h,), "[H]")
    q_in = h
    if q_a_weight is not None:
        q_in = q_a_weight.shape[0]
        _shape("q_a_weight", q_a_weight, (q_in, h), "[Rq, H]")
        _shape("q_a_norm_weight", q_a_norm_weight, (q_in,), "[Rq]")
    _shape("q_b_weight", q_b_weight, (hq * (nope + rope), q_in), "[Hq * (nope + rope), Rq or H]")
    _shape("kv_a_weight", kv_a_weight, (r + rope, h), "[r + rope, H]")
    _shape("kv_a_norm_weight", kv_a_norm_weight, (r,), "[r]")
    named = dict(input_norm_weight=input_norm_weight, q_a_weight=q_a_weight, q_a_norm_weight=q_a_norm_weight,
                 q_b_weight=q_b_weight, kv_a_weight=kv_a_weight, kv_a_norm_weight=kv_a_norm_weight, w_uk=w_uk)
    for name, w in named.items():
        if w is not None and w.dtype != hidden.dtype:
            raise ValueError(f"{name} is {w.dtype} but hidden is {hidden.dtype}; cast the weights to one dtype")
    if cos.dtype != sin.dtype or torch.promote_types(cos.dtype, hidden.dtype) != cos.dtype:
        raise ValueError(f"cos / sin are {cos.dtype} / {sin.dtype}; they must share a dtype at least as wide as "
                         f"hidden's {hidden.dtype}")
    checks.same_device("hidden", hidden, kv_cache=kv_cache, slot_mapping=slot_mapping, cos=cos, sin=sin, **named)
    checks.slots("slot_mapping", slot_mapping, t, "kv_cache", kv_cache)
    out = registry.call("mla_preprocess", hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight,
                        kv_a_weight, kv_a_norm_weight, w_uk, cos, sin, kv_cache, slot_mapping, float(eps),
                        bool(rope_interleave), float(eps if latent_eps is None else latent_eps))
    return MLAPreprocessOut(*out)


def mla_weights(params: dict[str, torch.Tensor], prefix: str, *, num_heads: int, qk_nope_head_dim: int,
                v_head_dim: int, input_norm_key: str | None = None) -> dict[str, torch.Tensor | None]:
    """The keyword weights of :func:`mla_preprocess` from Hugging Face parameter names.

    ``prefix`` is the attention module (``"model.layers.3.self_attn."``);
    ``input_norm_key`` defaults to that layer's ``input_layernorm.weight``.
    W_UK is a view of ``kv_b_proj.weight`` (no copy).

    Example
    -------
    >>> import torch
    >>> from cpattn.models import deepseek_v3 as ds
    >>> cfg = ds.DeepseekV3Config.tiny()
    >>> w = mla_weights(ds.init_params(cfg), "model.layers.0.self_attn.", num_heads=cfg.num_attention_heads,
    ...                 qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim)
    >>> tuple(w["w_uk"].shape), w["q_a_weight"] is not None
    ((4, 16, 32), True)
    """
    p = prefix
    if input_norm_key is None:
        input_norm_key = p.rsplit("self_attn.", 1)[0] + "input_layernorm.weight"
    kv_b = params[p + "kv_b_proj.weight"]  # [Hq * (nope + v), r]
    lora = p + "q_a_proj.weight" in params
    return dict(
        input_norm_weight=params[input_norm_key],
        q_a_weight=params[p + "q_a_proj.weight"] if lora else None,
        q_a_norm_weight=params[p + "q_a_layernorm.weight"] if lora else None,
        q_b_weight=params[p + ("q_b_proj.weight" if lora else "q_proj.weight")],
        kv_a_weight=params[p + "kv_a_proj_with_mqa.weight"],
        kv_a_norm_weight=params[p + "kv_a_layernorm.weight"],
        w_uk=kv_b.view(num_heads, qk_nope_head_dim + v_head_dim, kv_b.shape[-1])[:, :qk_nope_head_dim],
    )
