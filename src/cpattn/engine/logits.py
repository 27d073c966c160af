"""The logits dtype helpers (:mod:`cpattn.ops.logits`, below the engine and :mod:`cpattn.v4`, which both use
them); this path names the same objects."""

from cpattn.ops.logits import acc_dtype, as_logits, forward_logits

__all__ = ["acc_dtype", "as_logits", "forward_logits"]
