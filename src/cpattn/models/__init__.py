"""Functional reference models that load Hugging Face weights (DESIGN.md §2 ``models/``).

Parameters are plain ``dict[str, Tensor]`` keyed by the Hugging Face names;
a forward pass is a pure function of (params, config, tokens, attention
step of an explicit KV cache). Families:

- :mod:`cpattn.models.qwen3`: Qwen3 (GQA with q/k RMSNorm).
- :mod:`cpattn.models.deepseek_v3`: DeepSeek-V3 (MLA in absorbed form, exact MoE, YaRN).
- :mod:`cpattn.models.deepseek_v32`: DeepSeek-V3.2 (MLA + DSA lightning indexer).

:func:`cpattn.models.generate.generate` runs greedy generation with PCP
prefill and DCP decode on the simulated mesh.

Example
-------
>>> from cpattn.models import qwen3, load_checkpoint
>>> config, params = load_checkpoint("path/to/Qwen3-0.6B")  # doctest: +SKIP
>>> cfg = qwen3.Qwen3Config.from_hf(config)  # doctest: +SKIP
"""

from cpattn.models.common import load_checkpoint, normalize_params

FAMILIES = {"qwen3": "cpattn.models.qwen3", "deepseek_v3": "cpattn.models.deepseek_v3",
            "deepseek_v32": "cpattn.models.deepseek_v32"}


def family(config: dict):
    """The model module for a config dict's ``model_type`` (one of :data:`FAMILIES`)."""
    import importlib

    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"model_type {kind!r} is not supported; supported: {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[kind])


__all__ = ["load_checkpoint", "normalize_params", "family", "FAMILIES"]
