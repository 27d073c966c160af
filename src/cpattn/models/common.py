"""Building blocks shared by the reference models: RMSNorm, RoPE (default and
YaRN), SwiGLU MLPs, the pre-norm decoder trunk every family runs, and
loading weights into a plain dict. Mixture-of-experts blocks are in
:mod:`cpattn.models.moe`.

Numerics follow the reference (Hugging Face) implementations on purpose, so
whole-model results can be compared token for token:

- RMSNorm normalizes in float32, casts back to the input dtype, then scales.
- RoPE angles and cos/sin are computed in float32 from float32 inverse
  frequencies, then cast to the activation dtype.

Parameters are a flat ``dict[str, Tensor]`` keyed by the Hugging Face names
(``model.layers.0.self_attn.q_proj.weight`` ...). Routed experts are kept as
two stacked tensors per layer, ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I]; per-expert checkpoint keys
(``mlp.experts.{e}.gate_proj.weight`` ...) are stacked on load.

Not supported: quantized checkpoints (FP8 ``weight_scale_inv``, compressed-tensors ``weight_scale``), RoPE types
other than ``default`` and ``yarn``, multi-token-prediction layers (skipped).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from cpattn.ops.norm_rope import rms_norm, rope_half, rope_interleaved  # noqa: F401 (the models' names)


class Attention(Protocol):
    """What a model's layers call to attend: one step of an explicit KV cache and its parallel layout.

    ``attn.positions``: [T] int64 absolute positions of this step's tokens (for RoPE).
    ``attn(layer, q, k, v, scale) -> out`` with q: [T, Hq, Dqk], k: [T, Hkv, Dqk],
    v: [T, Hkv, Dv] or ``None`` (values are the first Dv dims of k: the MLA
    latent cache). The step stores k/v in its cache and returns out: [T, Hq, Dv];
    ``k=None`` means the step's cache already holds this step's rows.
    DSA models call ``attn.dsa(layer, q, kv, q_index, w_index, k_index, topk, scale)``
    (and ``attn.dsa_shared`` for layers that reuse a selection).
    ``attn.fused_cache(layer) -> (latent cache, slot_mapping [T]) | None``: a
    paged MLA latent cache the model may write itself in one fused op
    (:func:`cpattn.ops.mla_preprocess`), with this step's slots; None where
    the step keeps its rows otherwise. The steps are the engine's
    (:mod:`cpattn.engine.dense_cache`, :mod:`cpattn.engine.prefill_steps`,
    :mod:`cpattn.engine.paged_cache`).
    """

    positions: torch.Tensor

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float
    ) -> torch.Tensor: ...

    def fused_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...


# -- normalization and activations ---------------------------------------------


def lm_head(params: dict[str, torch.Tensor], cfg: Any) -> torch.Tensor:
    """The output projection [V, H] (the embedding when tied or when ``lm_head.weight`` is absent)."""
    w = params.get("lm_head.weight")
    if w is None or getattr(cfg, "tie_word_embeddings", False):
        return params["model.embed_tokens.weight"]
    return w


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``.

    x: [T, H]; gate, up: [I, H]; down: [H, I]. Returns [T, H].

    >>> swiglu(torch.randn(3, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)).shape
    torch.Size([3, 8])
    """
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# -- rotary position embedding ----------------------------------------------------


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a config dict: old style (``rope_theta`` + ``rope_scaling``) or new (``rope_parameters``)."""
    rp = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    if not rp:
        rp = dict(scaling)
    rp.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rp["rope_type"] = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rp["rope_type"] == "yarn":
        rp.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return rp


def rope_inv_freq(
    dim: int, rope: Mapping[str, Any], max_position_embeddings: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (float32) and the cos/sin scale ("attention factor").

    rope: ``{"rope_type": "default" | "yarn", "rope_theta": ..., ...}`` (see
    :func:`rope_parameters`). YaRN blends interpolated (``/ factor``) and
    extrapolated frequencies with a linear ramp between the correction dims of
    ``beta_fast`` and ``beta_slow`` rotations, and scales cos/sin by
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (or by
    ``attention_factor`` when given), ``mscale(s, m) = 0.1 m ln s + 1``.

    >>> inv, scale = rope_inv_freq(8, {"rope_type": "default", "rope_theta": 10000.0})
    >>> inv.shape, scale
    (torch.Size([4]), 1.0)
    """
    base = float(rope["rope_theta"])
    kind = rope.get("rope_type", "default")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim  # [dim/2]
    if kind == "default":
        return 1.0 / (base**exponents), 1.0
    if kind != "yarn":
        raise ValueError(f"rope_type {kind!r} is not supported; supported: 'default', 'yarn'")
    factor = rope.get("factor")
    orig = rope["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / orig
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # dim index where a wave turns `rotations` times
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    extrapolate = 1 - ramp
    pos_freqs = base**exponents
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention_factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, dim/2] in ``dtype`` for integer positions [T] (angles in float32).

    >>> cos, sin = rope_cos_sin(torch.arange(5), torch.ones(4), 1.0, torch.float32)
    >>> cos.shape
    torch.Size([5, 4])
    """
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device, torch.float32)[None]  # [T, dim/2]
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


# -- the decoder trunk every family shares --------------------------------------------


def mlp_dense(p: dict[str, torch.Tensor], pre: str, x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP stored under ``pre`` (``pre + "gate_proj.weight"`` ...). x: [T, H] -> [T, H].

    >>> p = {"m.gate_proj.weight": torch.ones(6, 4), "m.up_proj.weight": torch.ones(6, 4),
    ...      "m.down_proj.weight": torch.ones(4, 6)}
    >>> mlp_dense(p, "m.", torch.zeros(2, 4)).abs().sum().item()
    0.0
    """
    return swiglu(x, p[pre + "gate_proj.weight"], p[pre + "up_proj.weight"], p[pre + "down_proj.weight"])


Block = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, normed x [T, H]) -> [T, H]


def pre_norm_decoder(
    params: dict[str, torch.Tensor],
    cfg: Any,
    tokens: torch.Tensor,
    attention: Block,
    mlp: Block,
    *,
    logits_index: torch.Tensor | None = None,
    hidden_layers: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict[int | str, torch.Tensor]]:
    """Embedding, ``cfg.num_hidden_layers`` pre-norm residual layers, final norm, lm_head.

    Layer i, on the residual stream h [T, H]::

        h = h + attention(i, rms_norm(h, input_layernorm))
        h = h + mlp(i, rms_norm(h, post_attention_layernorm))

    The families differ only in ``attention`` and ``mlp`` (closures over
    their weights, RoPE tables and attention step).

    Arguments
    ---------
    params: Hugging Face names -> tensors; tokens: [T] int64.
    logits_index: optional [T'] rows to project to the vocabulary.
    hidden_layers: None, or layer indices (a tuple, possibly empty) whose
        residual stream to return.

    Returns
    -------
    logits [T or T', V]; with ``hidden_layers`` the pair ``(logits, hidden)``:
    ``hidden["norm"]`` [T, H] the final-normed hidden state of every row
    (``hidden["norm"][logits_index] @ lm_head^T == logits``), ``hidden[i]``
    [T, H] the residual stream after layer i.

    Example
    -------
    >>> p = {"model.embed_tokens.weight": torch.eye(4), "model.norm.weight": torch.ones(4),
    ...      "model.layers.0.input_layernorm.weight": torch.ones(4),
    ...      "model.layers.0.post_attention_layernorm.weight": torch.ones(4)}
    >>> class Cfg:
    ...     num_hidden_layers, rms_norm_eps, tie_word_embeddings = 1, 1e-6, True
    >>> zero = lambda i, x: torch.zeros_like(x)
    >>> logits, hidden = pre_norm_decoder(p, Cfg, torch.tensor([1, 2]), zero, zero, hidden_layers=(0,))
    >>> logits.shape, sorted(hidden, key=str), hidden[0].tolist()[0]
    (torch.Size([2, 4]), [0, 'norm'], [0.0, 1.0, 0.0, 0.0])
    """
    n, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    keep = () if hidden_layers is None else tuple(hidden_layers)
    bad = [i for i in keep if not (isinstance(i, int) and 0 <= i < n)]
    if bad:
        raise ValueError(f"hidden_layers {bad} are not layer indices of this {n}-layer model; use 0..{n - 1}")
    p = params
    h = F.embedding(tokens, p["model.embed_tokens.weight"])  # [T, H]
    hidden: dict[int | str, torch.Tensor] = {}
    for i in range(n):
        pre = f"model.layers.{i}."
        h = h + attention(i, rms_norm(h, p[pre + "input_layernorm.weight"], eps))
        h = h + mlp(i, rms_norm(h, p[pre + "post_attention_layernorm.weight"], eps))
        if i in keep:
            hidden[i] = h
    h = rms_norm(h, p["model.norm.weight"], eps)  # [T, H]
    logits = F.linear(h if logits_index is None else h[logits_index], lm_head(p, cfg))
    if hidden_layers is None:
        return logits
    hidden["norm"] = h
    return logits, hidden


# -- weights ----------------------------------------------------------------------

_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# last name parts of quantized checkpoints' extra tensors (FP8 block scales, compressed-tensors, GPTQ / AWQ)
QUANT_PARTS = ("weight_scale_inv", "weight_scale", "input_scale", "weight_zero_point", "weight_packed",
               "weight_global_scale", "input_global_scale", "weight_shape", "qweight", "qzeros", "scales", "g_idx")


def quantized_part(name: str) -> bool:
    """Whether a checkpoint tensor name belongs to a quantized format (a scale, zero point, packed weight).

    >>> quantized_part("model.layers.0.mlp.down_proj.weight_scale"), quantized_part("model.hc_head.hc_scale")
    (True, False)
    """
    return name.rsplit(".", 1)[-1] in QUANT_PARTS


def default_load_dtype(name: str, dtype: torch.dtype) -> torch.dtype | None:
    """The default rule of :func:`normalize_params`: router weights, ``e_score_correction_bias`` and the DSA
    indexer's ``weights_proj`` as stored (None), everything else ``dtype``."""
    keep = name.endswith(("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight"))
    return None if keep else dtype


def normalize_params(state: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None,
                     load_dtype: Callable[[str, torch.dtype], torch.dtype | None] | None = None
                     ) -> dict[str, torch.Tensor]:
    """A plain ``{name: tensor}`` dict from a Hugging Face state dict.

    Per-expert MoE weights are stacked into ``<prefix>.experts.gate_up_proj``
    [E, 2I, H] and ``<prefix>.experts.down_proj`` [E, H, I]; floating tensors
    take ``load_dtype(name, dtype)`` when ``dtype`` is given (None: as stored;
    default :func:`default_load_dtype`: router weights,
    ``e_score_correction_bias`` and the DSA indexer's ``weights_proj`` stay
    as stored, float32 as the reference keeps them; a family declares its own
    rule as ``ModelFamily.load_dtype``). Tensors are detached. A quantized
    checkpoint's tensors (:func:`quantized_part`) are refused.

    >>> normalize_params({"a.weight": torch.ones(2)})["a.weight"].tolist()
    [1.0, 1.0]
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        if quantized_part(name):
            raise ValueError(
                f"checkpoint tensor {name!r} is part of a quantized format (FP8 / compressed-tensors scales); "
                "quantized checkpoints are not supported. Dequantize to bf16/fp32 first."
            )
        m = _EXPERT_KEY.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t.detach()
    for prefix, per in experts.items():
        ids = sorted(per)
        if ids != list(range(len(ids))):
            raise ValueError(f"{prefix}: expert ids {ids[:8]}... are not 0..E-1; the checkpoint is incomplete")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([per[e]["down_proj"] for e in ids])
    if dtype is not None:
        rule = load_dtype or default_load_dtype
        for name, t in out.items():
            target = rule(name, dtype) if t.is_floating_point() else None
            if target is not None:
                out[name] = t.to(target)
    return out


def load_checkpoint(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a local Hugging Face checkpoint directory: ``config.json`` + ``*.safetensors``.

    Returns (config dict, params dict as :func:`normalize_params` makes it,
    with the family's names and dtype rule: ``ModelFamily.rename`` /
    ``load_dtype``). Before any weight is read, config.json's fields and the
    safetensors headers are checked against what the family expects
    (:func:`cpattn.models.checkpoint.check_checkpoint`): a malformed or
    unsupported checkpoint raises a one-line ValueError naming the file and
    the field or tensor. Nothing is downloaded.

    >>> cfg, params = load_checkpoint("path/to/Qwen3-0.6B")  # doctest: +SKIP
    """
    from cpattn.models.checkpoint import load_checked

    return load_checked(path, dtype=dtype)


def config_dict(config: Any) -> dict[str, Any]:
    """A plain dict from a Hugging Face config object, a dict, or a path to config.json."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        from cpattn.models.checkpoint import read_config

        p = os.fspath(config)
        return read_config(os.path.join(p, "config.json") if os.path.isdir(p) else p)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a dict, a config.json path or a transformers config; got {type(config).__name__}")
