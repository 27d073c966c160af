"""Functional reference models that load Hugging Face weights (DESIGN.md §2 ``models/``).

Parameters are plain ``dict[str, Tensor]`` keyed by the Hugging Face names;
a forward pass is a pure function of (params, config, tokens, attention
step of an explicit KV cache). Families:

- :mod:`cpattn.models.qwen3`: Qwen3 (GQA with q/k RMSNorm).
- :mod:`cpattn.models.deepseek_v3`: DeepSeek-V3 (MLA in absorbed form, exact MoE, YaRN).
- :mod:`cpattn.models.deepseek_v32`: DeepSeek-V3.2 (MLA + DSA lightning indexer).

:func:`cpattn.models.generate.generate` runs greedy generation with PCP
prefill and DCP decode on the simulated mesh;
:func:`cpattn.models.generate.generate_on_rank` is the same program for one
rank of a real group (gloo processes, torchrun). Beyond plain generation:

- :mod:`cpattn.models.speculative` (+ :mod:`cpattn.models.drafters`):
  speculative decoding (n-gram or draft-model drafters, greedy), 1 + k
  tokens verified in one DCP decode step, optionally graph-captured;
- :mod:`cpattn.models.disagg`: P/D disaggregation, a PCP prefill engine
  sending whole KV blocks to a DCP decode engine over torch.distributed;
- :mod:`cpattn.models.pcp_dcp`: PCP prefill writing the DCP layout
  directly (opt-in ``ParallelConfig(allow_pcp_with_dcp=True)``).

What is supported (details in each module):

- attention: GQA/MQA with q/k norm (Qwen3); MLA in absorbed form for
  prefill and decode (DeepSeek-V3); MLA + DSA lightning indexer with exact
  top-k (DeepSeek-V3.2);
- layouts: one device; PCP prefill (ring or all-gather; DSA-CP with a
  head-tail or contiguous split for DSA); DCP decode over a paged,
  interleaved cache (``ag_rs`` or ``a2a`` merge; key-sharded exact top-k for
  DSA); a PCP prefill handing its KV to a DCP decode (P/D, :mod:`cpattn.models.disagg`);
- MoE computed exactly (sigmoid router with correction bias, group-limited
  top-k, shared experts); RoPE ``default`` and ``yarn`` (with mscale);
  tied embeddings; float32 / float64 / bfloat16 parameters;
- weights: a Hugging Face state dict or a local checkpoint directory
  (``config.json`` + ``*.safetensors``, per-expert or stacked experts).

Not supported: quantized (FP8) checkpoints, sliding-window attention,
multi-token-prediction layers, GLM-5's cross-layer top-k sharing,
sampling / end-of-sequence handling (generation is greedy, fixed length).

Example
-------
>>> from cpattn.models import qwen3, load_checkpoint
>>> config, params = load_checkpoint("path/to/Qwen3-0.6B")  # doctest: +SKIP
>>> cfg = qwen3.Qwen3Config.from_hf(config)  # doctest: +SKIP
"""

import importlib
from types import ModuleType

from cpattn.models.common import load_checkpoint, normalize_params

FAMILIES = {"qwen3": "cpattn.models.qwen3", "deepseek_v3": "cpattn.models.deepseek_v3",
            "deepseek_v32": "cpattn.models.deepseek_v32"}


def family(config: dict) -> ModuleType:
    """The model module for a config dict's ``model_type`` (one of :data:`FAMILIES`).

    >>> family({"model_type": "qwen3"}).__name__
    'cpattn.models.qwen3'
    """
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"model_type {kind!r} is not supported; supported: {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[kind])


def resolve_model(model: ModuleType | str) -> ModuleType:
    """A model module, given itself or its family name ("qwen3", "deepseek_v3", "deepseek_v32")."""
    return model if isinstance(model, ModuleType) else family({"model_type": model})


__all__ = ["load_checkpoint", "normalize_params", "family", "resolve_model", "FAMILIES"]
