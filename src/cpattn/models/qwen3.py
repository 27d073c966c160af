"""Qwen3 (dense, GQA with per-head q/k RMSNorm) as a pure function.

``forward(params, cfg, tokens, attn)`` runs the whole decoder on one step's
packed tokens; ``attn`` is the step of an explicit KV cache (see
:mod:`cpattn.models.cache`), which also gives the positions for RoPE.

Supported: GQA/MQA, q/k norm, RoPE ``default`` and ``yarn``, tied or untied
embeddings, ``attention_bias``. Not supported: sliding-window layers
(``use_sliding_window``), Qwen3-MoE (a different architecture).

Example
-------
>>> import torch
>>> from cpattn.models import qwen3
>>> from cpattn.models.cache import DenseKVCache
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> params = qwen3.init_params(cfg, seed=0)
>>> cache = qwen3.empty_cache(cfg, batch=1, max_len=8)
>>> step = cache.step([3])
>>> qwen3.forward(params, cfg, torch.tensor([1, 2, 3]), step).shape
torch.Size([3, 32])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from cpattn.engine.family import KVLayout, ModelFamily
from cpattn.models.cache import DenseKVCache
from cpattn.models.common import (
    Attention,
    config_dict,
    lm_head,
    rms_norm,
    rope_cos_sin,
    rope_half,
    rope_inv_freq,
    rope_parameters,
    swiglu,
)


@dataclass(frozen=True)
class Qwen3Config:
    """The Qwen3 hyper-parameters the forward pass reads (names as in config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0})
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, config: Any) -> Qwen3Config:
        """From a transformers ``Qwen3Config``, a config.json dict, or a checkpoint path."""
        d = config_dict(config)
        if d.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"model_type is {d.get('model_type')!r}; cpattn.models.qwen3 expects 'qwen3'")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported by cpattn.models.qwen3; set it to False")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope=rope_parameters(d),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
        )

    @property
    def kv_dims(self) -> tuple[int, int, int, bool]:
        """(kv heads, key dim, value dim, values-share-keys) of one cache row."""
        return self.num_key_value_heads, self.head_dim, self.head_dim, False


def empty_cache(cfg: Qwen3Config, *, batch: int, max_len: int, dtype=torch.float32, device="cpu") -> DenseKVCache:
    """A dense single-device KV cache for ``batch`` requests of up to ``max_len`` tokens."""
    h, dk, dv, shared = cfg.kv_dims
    return DenseKVCache.empty(num_layers=cfg.num_hidden_layers, batch=batch, max_len=max_len, kv_heads=h,
                              dk=dk, dv=dv, shared_v=shared, dtype=dtype, device=device)


def forward(
    params: dict[str, torch.Tensor],
    cfg: Qwen3Config,
    tokens: torch.Tensor,
    attn: Attention,
    *,
    logits_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of one step's packed tokens.

    Arguments
    ---------
    params: Hugging Face names -> tensors (``model.embed_tokens.weight`` ...).
    tokens: [T] int64, this step's tokens of every request, packed.
    attn: the step of a KV cache; ``attn.positions`` [T] are the RoPE positions.
    logits_index: optional [T'] rows to project to the vocabulary (e.g. each
        request's last token); default all T.

    Returns
    -------
    logits: [T or T', vocab_size] in the params' dtype.
    """
    p, eps = params, cfg.rms_norm_eps
    t, hd = tokens.shape[0], cfg.head_dim
    h = F.embedding(tokens, p["model.embed_tokens.weight"])  # [T, H]
    inv_freq, att_factor = rope_inv_freq(hd, cfg.rope, cfg.max_position_embeddings)
    cos, sin = rope_cos_sin(attn.positions, inv_freq, att_factor, h.dtype)  # [T, hd/2]
    scale = hd**-0.5
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        x = rms_norm(h, p[pre + "input_layernorm.weight"], eps)
        q = _linear(x, p, pre + "self_attn.q_proj").view(t, -1, hd)  # [T, Hq, hd]
        k = _linear(x, p, pre + "self_attn.k_proj").view(t, -1, hd)  # [T, Hkv, hd]
        v = _linear(x, p, pre + "self_attn.v_proj").view(t, -1, hd)  # [T, Hkv, hd]
        q = rope_half(rms_norm(q, p[pre + "self_attn.q_norm.weight"], eps), cos, sin)
        k = rope_half(rms_norm(k, p[pre + "self_attn.k_norm.weight"], eps), cos, sin)
        o = attn(i, q, k, v, scale)  # [T, Hq, hd]
        h = h + _linear(o.reshape(t, -1), p, pre + "self_attn.o_proj")
        x = rms_norm(h, p[pre + "post_attention_layernorm.weight"], eps)
        mlp = pre + "mlp."
        h = h + swiglu(x, p[mlp + "gate_proj.weight"], p[mlp + "up_proj.weight"], p[mlp + "down_proj.weight"])
    h = rms_norm(h, p["model.norm.weight"], eps)
    if logits_index is not None:
        h = h[logits_index]
    return F.linear(h, lm_head(p, cfg))


def _linear(x: torch.Tensor, p: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, p[name + ".weight"], p.get(name + ".bias"))


def init_params(cfg: Qwen3Config, *, seed: int = 0, std: float = 0.02, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random parameters with the Hugging Face names (normal(0, std); norms at 1). For demos and tests."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hs, im = cfg.hidden_size, cfg.intermediate_size

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    p = {"model.embed_tokens.weight": rnd(cfg.vocab_size, hs), "model.norm.weight": torch.ones(hs, dtype=dtype)}
    if not cfg.tie_word_embeddings:
        p["lm_head.weight"] = rnd(cfg.vocab_size, hs)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        p.update({
            pre + "input_layernorm.weight": torch.ones(hs, dtype=dtype),
            pre + "post_attention_layernorm.weight": torch.ones(hs, dtype=dtype),
            pre + "self_attn.q_proj.weight": rnd(hq * hd, hs),
            pre + "self_attn.k_proj.weight": rnd(hkv * hd, hs),
            pre + "self_attn.v_proj.weight": rnd(hkv * hd, hs),
            pre + "self_attn.o_proj.weight": rnd(hs, hq * hd),
            pre + "self_attn.q_norm.weight": torch.ones(hd, dtype=dtype),
            pre + "self_attn.k_norm.weight": torch.ones(hd, dtype=dtype),
            pre + "mlp.gate_proj.weight": rnd(im, hs),
            pre + "mlp.up_proj.weight": rnd(im, hs),
            pre + "mlp.down_proj.weight": rnd(hs, im),
        })
    return p


def kv_layouts(cfg: Qwen3Config) -> tuple[KVLayout, ...]:
    """One GQA cache row per layer: ``num_key_value_heads`` keys and values of ``head_dim``."""
    return (KVLayout(cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim),) * cfg.num_hidden_layers


FAMILY = ModelFamily(name="qwen3", config_class=Qwen3Config, attention="gqa", forward=forward,
                     init_params=init_params, kv_layouts=kv_layouts, capturable=True)
