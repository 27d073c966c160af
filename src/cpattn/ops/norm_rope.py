"""RMSNorm and RoPE as the models compute them, shared by the model files and the fused ops.

One definition, so a fused op (:func:`cpattn.ops.mla_preprocess`) and the
model code it replaces round identically. The float64 oracles the tests
check it against are in ``tests/ref/mlapo.py``.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, normalized in float32 like the reference (float64 for float64 x).

    x: [..., D]; weight: [D]. Returns [..., D] in ``weight * x.dtype`` promotion. A float64 run stays
    float64: a float32 cast there would round two float64 paths that differ in their last bits to values
    a float32 ulp apart now and then, and every tight comparison after it would test that rounding.

    >>> rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6).shape
    torch.Size([2, 4])
    """
    acc = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for a float64 run
    xa = x.to(acc)
    xa = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xa.to(x.dtype)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX / half-split RoPE: dims ``i`` and ``i + d/2`` form a rotated pair.

    x: [T, H, d]; cos, sin: [T, d/2]. Returns [T, H, d].

    >>> rope_half(torch.tensor([[[1.0, 0.0]]]), torch.zeros(1, 1), torch.ones(1, 1)).tolist()
    [[[0.0, 1.0]]]
    """
    c, s = cos[:, None], sin[:, None]  # [T, 1, d/2]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE: dims ``2i`` and ``2i+1`` form a rotated pair.

    The output is laid out half-split (rotated evens, then rotated odds), as
    the reference does; q and k get the same permutation, so q.k is unchanged.
    x: [T, H, d]; cos, sin: [T, d/2]. Returns [T, H, d].

    >>> rope_interleaved(torch.tensor([[[1.0, 2.0, 3.0, 4.0]]]), torch.ones(1, 2), torch.zeros(1, 2)).tolist()
    [[[1.0, 3.0, 2.0, 4.0]]]
    """
    c, s = cos[:, None], sin[:, None]  # [T, 1, d/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
