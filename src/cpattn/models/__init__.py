"""Functional reference models that load Hugging Face weights: one file per family.

Parameters are plain ``dict[str, Tensor]`` keyed by the Hugging Face names;
a forward pass is a pure function of (params, config, tokens, an attention
step of an explicit KV cache). Each family file ends with ``FAMILY =
ModelFamily(...)``, its declaration to the engine
(:mod:`cpattn.models.family`: forward, init_params, config class, per-layer
KV layout, attention kind, whether the decode step is capturable). Running
them -- one device, PCP prefill, DCP decode, speculative decoding, P/D --
is the engine's job (:mod:`cpattn.engine`; classic entry points in
:mod:`cpattn.engine.classic`).

Families: :mod:`cpattn.models.qwen3` (GQA with q/k RMSNorm),
:mod:`cpattn.models.deepseek_v3` (absorbed MLA, exact MoE, YaRN),
:mod:`cpattn.models.deepseek_v32` (MLA + DSA lightning indexer); see
``cpattn.models.family.FAMILY_MODULES`` for every supported ``model_type``.

Supported everywhere: RoPE ``default`` and ``yarn``; tied embeddings;
float32 / float64 / bfloat16 parameters; weights from a Hugging Face state
dict or a local checkpoint directory (``config.json`` + ``*.safetensors``).
Not supported: quantized (FP8, compressed-tensors) checkpoints, sampling other than greedy.
:func:`load_checkpoint` checks config.json and the safetensors headers
against the family before reading any weight (:func:`check_checkpoint`
alone does only that): a malformed or mismatched checkpoint is one
ValueError line naming the file and the field or tensor.

Example
-------
>>> from cpattn.models import qwen3, load_checkpoint
>>> config, params = load_checkpoint("path/to/Qwen3-0.6B")  # doctest: +SKIP
>>> cfg = qwen3.Qwen3Config.from_hf(config)  # doctest: +SKIP
"""

from cpattn.models.checkpoint import check_checkpoint
from cpattn.models.common import load_checkpoint, normalize_params

__all__ = ["check_checkpoint", "load_checkpoint", "normalize_params"]
