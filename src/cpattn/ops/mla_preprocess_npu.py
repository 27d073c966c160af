"""Ascend kernel of ``mla_preprocess`` on ``torch_npu.npu_mla_prolog_v3``, registered by :func:`register`.

UNTESTED ON HARDWARE. Written from torch_npu's documentation only
(Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_mla_prolog_v3.md``);
no Ascend device was available. CI checks the argument plumbing against a
plain-torch stand-in of the documented semantics (tests/test_mla_preprocess.py).
Importing this module does not import torch_npu; :func:`register` does.

Facts used from that page:

- ``npu_mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr,
  rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, *,
  cache_index=None, rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode, query_norm_flag, ...)``
  returns ``(query_out [T, N, Hckv], query_rope_out [T, N, Dr],
  dequant_scale_q_nope, query_norm [T, Hcq], dequant_scale_q_norm)``;
- it starts from ``x @ W_DQ``: the layer's input RMSNorm is not part of it
  (done here with plain torch first);
- weights are ``[in, out]`` (``weight_dq [He, Hcq]``, ``weight_uq_qr [Hcq,
  N*(D+Dr)]``, ``weight_dkv_kr [He, Hckv+Dr]``) in FRACTAL_NZ format
  (``torch_npu.npu_format_cast(w, 29)``), ``weight_uk [N, D, Hckv]`` in ND;
  inputs must be contiguous;
- ``rope_sin`` / ``rope_cos`` are ``[T, Dr]``; its RoPE is "interleave-half":
  ``y = cat(x[::2], x[1::2]) * cos + cat(-x[1::2], x[::2]) * sin``, which is
  DeepSeek's interleaved RoPE with the half-split output layout the models
  use, given ``cos = cat(c, c)`` of our ``[T, Dr/2]`` tables;
- ``cache_mode="TND"`` writes the per-token results into ``kv_cache [T, 1,
  Hckv]`` and ``kr_cache [T, 1, Dr]`` without ``cache_index`` (indices are not
  validated by the kernel, and -1 is not a documented value), so the paged
  write with slot -1 skipping is done here with :func:`cpattn.ops.rows.scatter_rows`;
- ``query_norm_flag=True`` also returns the normed query latent ``c^Q`` (our ``q_lora``);
- non-quantized mode needs bfloat16; documented sizes: He in {1024, 2048,
  3072, 4096, 5120, 6144, 7168, 7680, 8192}, Hcq in {1536, 2048}, N a power
  of two up to 128, Hckv = 512, D in {128, 192}, Dr = 64.

Calls outside those limits (no q LoRA, half-split RoPE, other dtypes or
sizes) run the op's device-generic torch body. Format-cast weights are cached
per live source tensor (dropped with it, refreshed when it is modified in place).
"""

from __future__ import annotations

import weakref

import torch

from cpattn.ops import registry
from cpattn.ops.norm_rope import rms_norm
from cpattn.ops.rows import scatter_rows

HE = {1024, 2048, 3072, 4096, 5120, 6144, 7168, 7680, 8192}
HCQ = {1536, 2048}
HEADS = {1, 2, 4, 8, 16, 32, 64, 128}
NZ_FORMAT = 29  # FRACTAL_NZ
_nz_cache: dict[int, tuple] = {}  # id(weight) -> (weakref, version, cast weight)


def fits_prolog(hidden, q_a_weight, w_uk, cos, kv_cache, rope_interleave: bool) -> bool:
    """Whether a call is inside ``npu_mla_prolog_v3``'s documented non-quantized limits."""
    hq, nope, r = w_uk.shape
    return (
        q_a_weight is not None and rope_interleave and hidden.dtype == torch.bfloat16
        and kv_cache.dtype == torch.bfloat16 and hidden.shape[1] in HE and q_a_weight.shape[0] in HCQ
        and hq in HEADS and r == 512 and nope in (128, 192) and 2 * cos.shape[1] == 64
    )


def _nz(torch_npu, w: torch.Tensor) -> torch.Tensor:
    """``w.T`` ([out, in] -> [in, out]) as a contiguous FRACTAL_NZ tensor, cached per live source weight."""
    hit = _nz_cache.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    nz = torch_npu.npu_format_cast(w.t().contiguous(), NZ_FORMAT)
    _nz_cache[id(w)] = (weakref.ref(w, lambda _, k=id(w): _nz_cache.pop(k, None)), w._version, nz)
    return nz


def mla_preprocess_npu(hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight,
                       kv_a_norm_weight, w_uk, cos, sin, kv_cache, slot_mapping, eps, rope_interleave, latent_eps):
    """The NPU kernel: input RMSNorm in torch, ``npu_mla_prolog_v3`` (TND), the paged write by slot."""
    from cpattn.ops.npu import import_torch_npu

    args = (hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_a_norm_weight,
            w_uk, cos, sin, kv_cache, slot_mapping, eps, rope_interleave, latent_eps)
    if not fits_prolog(hidden, q_a_weight, w_uk, cos, kv_cache, rope_interleave):
        return _generic(*args)
    torch_npu = import_torch_npu()
    t, r, rope = hidden.shape[0], w_uk.shape[2], 2 * cos.shape[1]
    x = (hidden if input_norm_weight is None else rms_norm(hidden, input_norm_weight, eps)).contiguous()  # [T, He]
    kv_c = x.new_empty(t, 1, r)  # TND result buffers
    k_pe = x.new_empty(t, 1, rope)
    q_nope, q_rope, _, q_lora, _ = torch_npu.npu_mla_prolog_v3(
        x, _nz(torch_npu, q_a_weight), _nz(torch_npu, q_b_weight), w_uk.contiguous(), _nz(torch_npu, kv_a_weight),
        q_a_norm_weight.contiguous(), kv_a_norm_weight.contiguous(),
        torch.cat([sin, sin], dim=-1).contiguous(), torch.cat([cos, cos], dim=-1).contiguous(), kv_c, k_pe,
        rmsnorm_epsilon_cq=latent_eps, rmsnorm_epsilon_ckv=latent_eps, cache_mode="TND", query_norm_flag=True,
    )
    kv = torch.cat([kv_c, k_pe], dim=-1)  # [T, 1, r + rope]
    scatter_rows(kv_cache.view(-1, *kv_cache.shape[2:]), kv, slot_mapping)
    return torch.cat([q_nope, q_rope], dim=-1), kv, q_lora, (x if input_norm_weight is not None else x.clone())


def _generic(hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight, kv_a_weight, kv_a_norm_weight,
             w_uk, cos, sin, kv_cache, slot_mapping, eps, rope_interleave, latent_eps):
    from cpattn.ops.mla_preprocess import mla_chain  # the module's function (the package attribute is the op)

    q, kv, q_lora, x = mla_chain(hidden, input_norm_weight, q_a_weight, q_a_norm_weight, q_b_weight,
                                 kv_a_weight, kv_a_norm_weight, w_uk, cos, sin, eps, rope_interleave, latent_eps)
    scatter_rows(kv_cache.view(-1, *kv_cache.shape[2:]), kv, slot_mapping)
    return q, kv, q_lora, (x if input_norm_weight is not None else x.clone())  # an op's output may not alias an input


def register() -> str:
    """Import torch_npu and register the NPU kernel of ``mla_preprocess``; returns "npu". Idempotent.

    Example
    -------
    >>> from cpattn.ops import mla_preprocess_npu
    >>> mla_preprocess_npu.register()  # doctest: +SKIP
    'npu'
    """
    import cpattn.ops.mla_preprocess  # noqa: F401 (defines the op)
    from cpattn.ops.npu import import_torch_npu

    import_torch_npu()
    device = torch._C._get_privateuse1_backend_name()
    if device != "npu":
        raise RuntimeError(f"torch_npu imported but the PrivateUse1 backend is named {device!r}, expected 'npu'")
    if device not in registry.kernels("mla_preprocess"):
        registry.kernel("mla_preprocess", device)(mla_preprocess_npu)
    return device
