"""Qwen3.5-MoE text (``model_type`` ``qwen3_5_moe``, the Hub's composite form, and ``qwen3_5_moe_text``).

Qwen3.5's layout (split linear-layer input projections, composite checkpoint
with ``model.language_model.`` weights and a vision tower that is ignored)
with a sparse MoE block in every layer: softmax top-k, always renormalised,
plus a shared expert gated by ``sigmoid(shared_expert_gate)`` -- the
Qwen3-Next MoE block. This module declares the family over
:mod:`cpattn.models.qwen3_next`'s forward (the hybrid cache kind) with
:class:`Qwen3_5MoeConfig`. Image / video inputs are not supported.

>>> from cpattn.models.family import get_family
>>> fam = get_family("qwen3_5_moe")
>>> fam.name, fam.config_class.tiny().mlp_layer_types
('qwen3_5_moe', ('sparse', 'sparse', 'sparse', 'sparse'))
"""

from __future__ import annotations

import dataclasses

from cpattn.models.qwen3_next import FAMILY as _NEXT
from cpattn.models.qwen3_next import forward, init_params, kv_layouts, load_params, recurrent_cache  # noqa: F401
from cpattn.models.qwen3_next_config import Qwen3_5MoeConfig

__all__ = ["FAMILY", "Qwen3_5MoeConfig", "forward", "init_params", "kv_layouts", "load_params", "recurrent_cache"]

FAMILY = dataclasses.replace(_NEXT, name="qwen3_5_moe", config_class=Qwen3_5MoeConfig)
