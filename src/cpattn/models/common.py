"""Building blocks shared by the reference models: RMSNorm, RoPE (default and
YaRN), SwiGLU MLPs, DeepSeek MoE, and loading weights into a plain dict.

Numerics follow the reference (Hugging Face) implementations on purpose, so
whole-model results can be compared token for token:

- RMSNorm normalizes in float32, casts back to the input dtype, then scales.
- RoPE angles and cos/sin are computed in float32 from float32 inverse
  frequencies, then cast to the activation dtype.
- The MoE router runs in float32.

Parameters are a flat ``dict[str, Tensor]`` keyed by the Hugging Face names
(``model.layers.0.self_attn.q_proj.weight`` ...). Routed experts are kept as
two stacked tensors per layer, ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I]; per-expert checkpoint keys
(``mlp.experts.{e}.gate_proj.weight`` ...) are stacked on load.

Not supported: quantized checkpoints (FP8 ``weight_scale_inv``), RoPE types
other than ``default`` and ``yarn``, multi-token-prediction layers (skipped).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class Attention(Protocol):
    """What a model's layers call to attend: one step of an explicit KV cache and its parallel layout.

    ``attn.positions``: [T] int64 absolute positions of this step's tokens (for RoPE).
    ``attn(layer, q, k, v, scale) -> out`` with q: [T, Hq, Dqk], k: [T, Hkv, Dqk],
    v: [T, Hkv, Dv] or ``None`` (values are the first Dv dims of k: the MLA
    latent cache). The step stores k/v in its cache and returns out: [T, Hq, Dv].
    DSA models call ``attn.dsa(layer, q, kv, q_index, w_index, k_index, topk, scale)``.
    See :mod:`cpattn.models.cache` and :mod:`cpattn.models.dcp_cache`.
    """

    positions: torch.Tensor

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float
    ) -> torch.Tensor: ...


# -- normalization and activations ---------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, normalized in float32 like the reference.

    x: [..., D]; weight: [D]. Returns [..., D] in ``weight * x.dtype`` promotion.

    >>> rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6).shape
    torch.Size([2, 4])
    """
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX / half-split RoPE: dims ``i`` and ``i + d/2`` form a rotated pair.

    x: [T, H, d]; cos, sin: [T, d/2]. Returns [T, H, d].
    """
    c, s = cos[:, None], sin[:, None]  # [T, 1, d/2]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE: dims ``2i`` and ``2i+1`` form a rotated pair.

    The output is laid out half-split (rotated evens, then rotated odds), as
    the reference does; q and k get the same permutation, so q.k is unchanged.
    x: [T, H, d]; cos, sin: [T, d/2]. Returns [T, H, d].
    """
    c, s = cos[:, None], sin[:, None]  # [T, 1, d/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


# -- DeepSeek mixture of experts ----------------------------------------------------


def moe_route(
    x: torch.Tensor,
    router: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 sigmoid router with group-limited top-k, in float32.

    x: [T, H]; router: [E, H]; bias: [E] (``e_score_correction_bias``, used
    only for choosing). Groups of ``E / n_group`` experts are ranked by the sum
    of their two best biased scores, the best ``topk_group`` groups are kept,
    and the ``top_k`` best experts inside them are chosen. Weights are the
    unbiased sigmoid scores, optionally normalized, times the scaling factor.
    Returns (weights [T, top_k] float32, experts [T, top_k] int64).
    """
    t, e = x.shape[0], router.shape[0]
    scores = F.linear(x.to(torch.float32), router.to(torch.float32)).sigmoid()  # [T, E]
    choice = scores + bias.to(torch.float32)
    per_group = choice.view(t, n_group, e // n_group)  # [T, G, E/G]
    group_score = per_group.topk(min(2, e // n_group), dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
    keep = keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)  # [T, E]
    experts = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, experts


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Exact routed-expert sum, one expert at a time over the tokens routed to it.

    x: [T, H]; weights, experts: [T, k]; gate_up: [E, 2I, H]; down: [E, H, I].
    Returns [T, H] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t]).
    """
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        tok, slot = torch.nonzero(experts == e, as_tuple=True)  # tokens routed to e
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, down[e]) * weights[tok, slot, None].to(x.dtype)  # [n, H]
        out.index_add_(0, tok, y)
    return out


# -- weights ----------------------------------------------------------------------

_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def normalize_params(state: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A plain ``{name: tensor}`` dict from a Hugging Face state dict.

    Per-expert MoE weights are stacked into ``<prefix>.experts.gate_up_proj``
    [E, 2I, H] and ``<prefix>.experts.down_proj`` [E, H, I]; router weights and
    ``e_score_correction_bias`` stay float32 (as the reference keeps them);
    everything else is cast to ``dtype`` when given. Tensors are detached.

    >>> normalize_params({"a.weight": torch.ones(2)})["a.weight"].tolist()
    [1.0, 1.0]
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        if name.endswith("weight_scale_inv"):
            raise ValueError(
                f"checkpoint tensor {name!r} is an FP8 block scale; quantized checkpoints are not supported. "
                "Dequantize to bf16/fp32 first."
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
        for name, t in out.items():
            keep32 = name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias")
            if t.is_floating_point() and not keep32:
                out[name] = t.to(dtype)
    return out


def load_checkpoint(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a local Hugging Face checkpoint directory: ``config.json`` + ``*.safetensors``.

    Returns (config dict, params dict as :func:`normalize_params` makes it).
    Nothing is downloaded.

    >>> cfg, params = load_checkpoint("path/to/Qwen3-0.6B")  # doctest: +SKIP
    """
    from safetensors.torch import load_file

    path = os.fspath(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{path!r} has no config.json; pass a Hugging Face checkpoint directory")
    with open(cfg_file) as f:
        config = json.load(f)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path!r} has no *.safetensors files; only safetensors checkpoints are supported")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(os.path.join(path, f)))
    return config, normalize_params(state, dtype=dtype)


def config_dict(config: Any) -> dict[str, Any]:
    """A plain dict from a Hugging Face config object, a dict, or a path to config.json."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        p = os.fspath(config)
        with open(os.path.join(p, "config.json") if os.path.isdir(p) else p) as f:
            return json.load(f)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a dict, a config.json path or a transformers config; got {type(config).__name__}")
