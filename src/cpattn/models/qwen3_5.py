"""Qwen3.5 text (``model_type`` ``qwen3_5``, the Hub's composite form, and ``qwen3_5_text``): the Qwen3-Next forward.

Qwen3.5's text model is Qwen3-Next's with the linear layers' input
projections stored apart and dense MLPs (:mod:`cpattn.models.qwen3_next`
has both layouts); a Hub checkpoint nests the text config (``text_config``)
and stores the weights under ``model.language_model.`` beside a vision tower
that text generation ignores. This module only declares the family: the
hybrid cache kind, the same forward, :class:`Qwen3_5Config` (Qwen3.5's tiny
layout). Image / video inputs are not supported.

>>> from cpattn.models.family import get_family
>>> fam = get_family({"model_type": "qwen3_5"})
>>> fam.name, fam.cache, fam.config_class.tiny().split_projections
('qwen3_5', 'hybrid', True)
"""

from __future__ import annotations

import dataclasses

from cpattn.models.qwen3_next import FAMILY as _NEXT
from cpattn.models.qwen3_next import forward, init_params, kv_layouts, load_params, recurrent_cache  # noqa: F401
from cpattn.models.qwen3_next_config import Qwen3_5Config

__all__ = ["FAMILY", "Qwen3_5Config", "forward", "init_params", "kv_layouts", "load_params", "recurrent_cache"]

FAMILY = dataclasses.replace(_NEXT, name="qwen3_5", config_class=Qwen3_5Config)
