"""Plain reference of MLA decode preprocessing (the unfused chain), float64 by default.

Written for reading, not speed: RMSNorm as its formula, one matmul per
projection, the W_UK absorption head by head, RoPE pair by pair, the cache
write token by token. ``dtype`` picks the compute dtype: float64 is the
oracle; the same code in bfloat16 is the "plain implementation in the same
dtype" that tolerances are measured against.

Layouts (as the models keep them): RoPE outputs are laid out half-split,
``[rotated first elements of the pairs | rotated second elements]``; with
``rope_interleave`` the pairs are dims ``(2i, 2i+1)``, otherwise ``(i, i + d/2)``.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dim, in x's dtype."""
    return weight * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps))


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x: [T, H, d]; cos, sin: [T, d/2]. Pair i is (2i, 2i+1) or (i, i+d/2); out = [a' (d/2) | b' (d/2)]."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    for i in range(half):
        a, b = (x[..., 2 * i], x[..., 2 * i + 1]) if interleave else (x[..., i], x[..., i + half])
        c, s = cos[:, i, None], sin[:, i, None]  # [T, 1]
        out[..., i] = a * c - b * s
        out[..., half + i] = b * c + a * s
    return out


def mla_preprocess_ref(
    hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_a_norm_weight, w_uk,
    cos, sin, kv_cache, slot_mapping, eps: float, rope_interleave: bool, dtype: torch.dtype = torch.float64,
    latent_eps: float | None = None,
):
    """The chain on copies in ``dtype``; returns (q, kv, q_lora, x, cache) -- the cache a new tensor.

    Shapes as :func:`cpattn.ops.mla_preprocess.mla_preprocess`; ``cache`` is
    ``kv_cache`` in ``dtype`` with row ``slot_mapping[t]`` set to ``kv[t]``
    for every ``t`` whose slot is not -1.
    """
    f = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    t_len, (hq, nope, r) = hidden.shape[0], w_uk.shape
    rope = 2 * cos.shape[-1]
    latent_eps = eps if latent_eps is None else latent_eps
    x = f(hidden) if input_norm_weight is None else rms_norm_ref(f(hidden), f(input_norm_weight), eps)  # [T, H]
    if q_a_weight is None:
        q_lora = x.new_zeros(t_len, 0)
        q = x @ f(q_b_weight).T  # [T, Hq*(nope+rope)]
    else:
        q_lora = rms_norm_ref(x @ f(q_a_weight).T, f(q_a_norm_weight), latent_eps)  # [T, Rq]
        q = q_lora @ f(q_b_weight).T
    q = q.reshape(t_len, hq, nope + rope)
    q_lat = torch.stack([q[:, h, :nope] @ f(w_uk)[h] for h in range(hq)], dim=1)  # [T, Hq, r]
    q_rope = rope_ref(q[:, :, nope:], f(cos), f(sin), rope_interleave)  # [T, Hq, rope]
    ckv = x @ f(kv_a_weight).T  # [T, r + rope]
    c = rms_norm_ref(ckv[:, :r], f(kv_a_norm_weight), latent_eps)  # [T, r]
    k_rope = rope_ref(ckv[:, None, r:], f(cos), f(sin), rope_interleave)  # [T, 1, rope]
    kv = torch.cat([c[:, None], k_rope], dim=-1)  # [T, 1, r + rope]
    cache = kv_cache.to(dtype).clone()
    rows = cache.view(-1, *cache.shape[2:])  # [slots, 1, r + rope]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            rows[slot] = kv[t]
    return torch.cat([q_lat, q_rope], dim=-1), kv, q_lora, x, cache
