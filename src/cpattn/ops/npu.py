"""Ascend NPU kernels, registered under ``PrivateUse1`` by :func:`register`.

UNTESTED ON HARDWARE. This module was written from torch_npu's documentation
only; no Ascend device was available. CI checks the argument plumbing against
a stand-in that implements the documented semantics in plain torch
(tests/test_npu_lazy.py), not the real kernel.

Importing this module does not import torch_npu; :func:`register` does (call
it through ``cpattn.ops.enable_npu()``). torch_npu is an optional extra
(``pip install cpattn[npu]``): installing it without Ascend's CANN toolkit
breaks ``import torch``, so CPU CI never installs it.

``attention_with_lse`` runs the shared :func:`cpattn.ops.attention.varlen`
driver (split per request into an unmasked prefix block and a causal
diagonal block, merged by LSE) with one fused call per block:
``torch_npu.npu_fused_infer_attention_score`` in BNSD layout with
``softmax_lse_flag=True``. Facts used, from the torch_npu API reference
(Ascend/op-plugin ``docs/context/torch_npu-npu_fused_infer_attention_score.md``;
hiascend.com Pytorch API list, ptaoplist_000837 / ptaoplist_000768):

- keyword arguments ``num_heads``, ``num_key_value_heads`` (GQA, Hq/Hkv <= 64),
  ``input_layout="BNSD"``, ``sparse_mode``, ``atten_mask``, ``softmax_lse_flag``;
  the scale is ``scale`` in current releases and ``scale_value`` in older ones
  (Pytorch 6.0.RC2/RC3 API lists), so both are tried;
- returns ``(attention_out, softmax_lse)``; with the flag, lse is float32
  ``(B, N, Q_S, 1)`` (natural-log: max + log(sum(exp(s - max))));
- query dtype float16/bfloat16 only; head dim <= 512 and 16-aligned for
  float16/bfloat16; N <= 256;
- ``sparse_mode=0`` with no mask computes the full block; ``sparse_mode=3``
  (rightDownCausal) takes the optimised 2048x2048 lower-triangular mask;
  mask value 1/True means "masked out" (npu_fusion_attention's doc states
  this convention: docs/context/torch_npu-npu_fusion_attention.md).

Blocks the fused kernel does not cover (float32/float64, Dqk != Dv as in MLA's
576/512, head dims over 512 or not 16-aligned, more than 256 query heads or a
GQA ratio above 64) run the plain reference :func:`cpattn.ops.ref.dense_block`
on the device. The TND (packed) layout of the same kernel is not used: its
documented limits (equal q/k/v head counts, Dqk 192 or 128+64 rope) exclude
GQA.
"""

from __future__ import annotations

import torch

from cpattn.ops import attention, ref, registry

INSTALL_HINT = "pip install cpattn[npu] on a machine with Ascend CANN"
_MASK_SIZE = 2048  # the optimised causal mask of sparse_mode 2/3/4 is 2048 x 2048
_masks: dict[torch.device, torch.Tensor] = {}


def import_torch_npu():
    """Import and return torch_npu, or raise ImportError saying how to install it."""
    try:
        import torch_npu  # noqa: PLC0415 - optional dependency, imported on demand
    except ImportError as err:
        raise ImportError(
            f"cpattn's NPU kernels need torch_npu, which could not be imported ({err}). "
            f"Install it with `{INSTALL_HINT}` (torch_npu must match your torch and CANN versions), "
            "then call cpattn.ops.enable_npu()."
        ) from err
    return torch_npu


def register() -> str:
    """Import torch_npu and register the NPU kernels; return the device type used ("npu").

    torch_npu renames the ``PrivateUse1`` dispatch key to "npu"; the kernels
    are registered for that device type. Calling it again is a no-op.

    Example
    -------
    >>> import cpattn.ops
    >>> cpattn.ops.enable_npu()  # doctest: +SKIP
    """
    import_torch_npu()
    device = torch._C._get_privateuse1_backend_name()
    if device != "npu":
        raise RuntimeError(
            f"torch_npu imported but the PrivateUse1 backend is named {device!r}, expected 'npu'; "
            "another extension claimed PrivateUse1 first. Import torch_npu before other device extensions."
        )
    if device not in registry.kernels("attention_with_lse"):
        registry.kernel("attention_with_lse", device)(_attention_npu)
    return device


def _attention_npu(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
    # cu_seqlens may live on the NPU; the driver reads them on the host (plan step)
    return attention.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, fused_block)


def fits_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether one block ``q [Hq,Lq,D], k/v [Hkv,Lk,D*]`` is inside the fused kernel's documented limits."""
    hq, hkv, d = q.shape[0], k.shape[0], q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and v.shape[-1] == d
        and d <= 512
        and d % 16 == 0
        and hq <= 256
        and hq // hkv <= 64
    )


def fused_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request block on ``npu_fused_infer_attention_score`` (BNSD, B = 1).

    q: [Hq, Lq, D]; k, v: [Hkv, Lk, D]; causal blocks are square (Lq == Lk,
    the driver's diagonal block). Returns out [Hq, Lq, D] in q's dtype and
    lse [Hq, Lq] float32. Blocks outside the kernel's limits run
    :func:`cpattn.ops.ref.dense_block`.
    """
    if not fits_fused(q, k, v):
        return ref.dense_block(q, k, v, causal, scale)
    hq, hkv = q.shape[0], k.shape[0]
    kwargs = dict(num_heads=hq, num_key_value_heads=hkv, input_layout="BNSD", softmax_lse_flag=True)
    if causal:  # rightDownCausal with the optimised mask; square here, so top-left == bottom-right
        kwargs.update(sparse_mode=3, atten_mask=_causal_mask(q.device))
    else:
        kwargs.update(sparse_mode=0, atten_mask=None)
    out, lse = _fused_infer_attention(
        q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), scale, kwargs
    )  # out [1, Hq, Lq, D], lse [1, Hq, Lq, 1]
    return out[0].to(q.dtype), lse[0, :, :, 0].float()


def _fused_infer_attention(q, k, v, scale, kwargs):
    fia = import_torch_npu().npu_fused_infer_attention_score
    try:
        return fia(q, k, v, scale=scale, **kwargs)
    except TypeError as err:  # torch_npu releases before the rename call it scale_value
        if "scale" not in str(err):
            raise
        return fia(q, k, v, scale_value=scale, **kwargs)


def _causal_mask(device: torch.device) -> torch.Tensor:
    """[2048, 2048] bool, True above the diagonal (masked), cached per device."""
    if device not in _masks:
        ones = torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool, device=device)
        _masks[device] = torch.triu(ones, diagonal=1)
    return _masks[device]
