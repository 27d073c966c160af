"""Deprecated old path of :mod:`cpattn.models.deepseek_v4_blocks` (DeepSeek-V4's non-attention blocks: norms,
RoPE tail, hyper-connections, MoE -- model code, so it lives beside the model, not among the V4 attention
primitives).

Importing this module warns (DeprecationWarning) and re-exports every name.
"""

import warnings

from cpattn.models.deepseek_v4_blocks import (_swiglu_clamped, experts, experts_dense, hyper_head,  # noqa: F401
                                              hyper_mix, hyper_weights, mlp, rms_norm, rms_norm_unweighted,
                                              rope_tail, route)

warnings.warn("cpattn.v4.blocks moved to cpattn.models.deepseek_v4_blocks; import it from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["experts", "experts_dense", "hyper_head", "hyper_mix", "hyper_weights", "mlp", "rms_norm",
           "rms_norm_unweighted", "rope_tail", "route"]
