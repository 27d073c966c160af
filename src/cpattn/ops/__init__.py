"""cpattn's op registry: every kernel defined once (``torch.ops.cpattn.*``).

Public wrappers validate their arguments and call the registered op, so the
same entry point serves eager code and captured graphs.
"""

from __future__ import annotations

import sys

from cpattn.ops import registry
from cpattn.ops.attention import attention_with_lse
from cpattn.ops.merge import merge_attn_states
from cpattn.ops.compressor import gated_pool
from cpattn.ops.gated_delta import causal_conv1d, gated_delta_chunk, gated_delta_step
from cpattn.ops.mla_preprocess import mla_preprocess, mla_weights
from cpattn.ops.window_attention import window_attention_with_lse
from cpattn.ops.paged import paged_attention_with_lse
from cpattn.ops.rows import write_kv, write_kv_mla, write_rows
from cpattn.ops.dsa import indexer_scores, mla_softmax_scale, sparse_mla_attention_with_lse, topk_indices


def enable_npu() -> None:
    """Import torch_npu and register the Ascend (``PrivateUse1``) kernels.

    torch_npu is an optional extra (``pip install cpattn[npu]``) and is never
    imported unless asked for; installing it without Ascend's CANN toolkit
    breaks ``import torch``. Untested on hardware.
    """
    from cpattn.ops import mla_preprocess_npu, npu

    npu.register()
    mla_preprocess_npu.register()


if "torch_npu" in sys.modules:  # the user already imported it: register now
    enable_npu()

__all__ = [
    "attention_with_lse", "merge_attn_states", "paged_attention_with_lse", "write_kv", "write_kv_mla",
    "indexer_scores", "topk_indices", "sparse_mla_attention_with_lse", "mla_softmax_scale", "mla_preprocess",
    "mla_weights", "gated_pool", "window_attention_with_lse", "write_rows",
    "gated_delta_chunk", "gated_delta_step", "causal_conv1d",
    "registry", "enable_npu",
]
