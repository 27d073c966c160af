"""Deprecated old path of :mod:`cpattn.models.deepseek_v4_checkpoint` (DeepSeek-V4 checkpoint names -> the
Hugging Face names the model reads).

Importing this module warns (DeprecationWarning) and re-exports every name.
"""

import warnings

from cpattn.models.deepseek_v4_checkpoint import RENAMES, hf_name, param_name  # noqa: F401

warnings.warn("cpattn.v4.checkpoint moved to cpattn.models.deepseek_v4_checkpoint; import it from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["RENAMES", "hf_name", "param_name"]
