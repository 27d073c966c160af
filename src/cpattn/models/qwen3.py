"""Qwen3 (dense, GQA with per-head q/k RMSNorm) as a pure function.

``forward(params, cfg, tokens, attn)`` runs the whole decoder on one step's
packed tokens; ``attn`` is the step of an explicit KV cache (see
:class:`cpattn.models.common.Attention`), which also gives the positions for RoPE.

Supported: GQA/MQA, q/k norm, RoPE ``default`` and ``yarn``, tied or untied
embeddings, ``attention_bias``. Qwen3-MoE (:mod:`cpattn.models.qwen3_moe`)
reuses :func:`attention_block` and :func:`init_layers`. Not supported:
sliding-window layers (``use_sliding_window``).

Example
-------
>>> import torch
>>> from cpattn.models import qwen3
>>> from cpattn.engine.dense_cache import DenseKVCache
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> params = qwen3.init_params(cfg, seed=0)
>>> cache = DenseKVCache.empty(qwen3.FAMILY.kv_layouts(cfg), batch=1, max_len=8)
>>> step = cache.step([3])
>>> qwen3.forward(params, cfg, torch.tensor([1, 2, 3]), step).shape
torch.Size([3, 32])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from cpattn.models.draft_target import gqa_target
from cpattn.models.family import KVLayout, ModelFamily
from cpattn.models.common import (
    Attention,
    config_dict,
    mlp_dense,
    pre_norm_decoder,
    rms_norm,
    rope_cos_sin,
    rope_half,
    rope_inv_freq,
    rope_parameters,
)
from cpattn.models.checks import check_divides, check_fields, check_rope

# config.json fields as they must be (cpattn.models.checks.check_fields); "?": may be absent or null
CONFIG_RULES = {"vocab_size": "int>0", "hidden_size": "int>0", "intermediate_size": "int>0",
                "num_hidden_layers": "int>0", "num_attention_heads": "int>0", "num_key_value_heads": "int>0?",
                "head_dim": "int>0?", "rms_norm_eps": "num>0?", "max_position_embeddings": "int>0?",
                "tie_word_embeddings": "bool?", "attention_bias": "bool?", "use_sliding_window": "bool?"}


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
    def tiny(cls, **over) -> Qwen3Config:
        """A tiny test/demo configuration (2 layers, hidden 128, GQA 4:1 with one KV head, vocab 512)."""
        base = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=32)
        return cls(**{**base, **over})

    @classmethod
    def from_hf(cls, config: Any) -> Qwen3Config:
        """From a transformers ``Qwen3Config``, a config.json dict, or a checkpoint path."""
        return cls(**qwen3_fields(config_dict(config), "qwen3"))

    def to_hf(self) -> dict:
        """The config.json dict (transformers' field names) that :meth:`from_hf` reads back equal.

        >>> cfg = Qwen3Config.tiny()
        >>> Qwen3Config.from_hf(cfg.to_hf()) == cfg, cfg.to_hf()["rope_parameters"]["rope_theta"]
        (True, 1000000.0)
        """
        d = {k: v for k, v in asdict(self).items() if k != "rope"}
        return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **d, "rope_parameters": dict(self.rope)}



def qwen3_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The :class:`Qwen3Config` fields of a config.json dict whose ``model_type`` must be ``model_type``.

    >>> qwen3_fields({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8,
    ...               "num_hidden_layers": 1, "num_attention_heads": 2}, "qwen3")["head_dim"]
    2
    """
    if d.get("model_type", model_type) != model_type:
        raise ValueError(f"model_type is {d.get('model_type')!r}; this family expects {model_type!r}")
    check_fields(d, CONFIG_RULES)
    check_divides(d, "num_key_value_heads", "num_attention_heads")
    check_rope(rope_parameters(d))
    if d.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=True is not supported for {model_type!r}; set it to False")
    return dict(
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


def forward(
    params: dict[str, torch.Tensor],
    cfg: Qwen3Config,
    tokens: torch.Tensor,
    attn: Attention,
    *,
    logits_index: torch.Tensor | None = None,
    hidden_layers: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """Logits of one step's packed tokens.

    Arguments
    ---------
    params: Hugging Face names -> tensors (``model.embed_tokens.weight`` ...).
    tokens: [T] int64, this step's tokens of every request, packed.
    attn: the step of a KV cache; ``attn.positions`` [T] are the RoPE positions.
    logits_index: optional [T'] rows to project to the vocabulary (e.g. each
        request's last token); default all T.
    hidden_layers: optional layer indices; then ``(logits, hidden)`` is
        returned (see :func:`cpattn.models.common.pre_norm_decoder`).

    Returns
    -------
    logits: [T or T', vocab_size] in the params' dtype (and ``hidden``).
    """
    cos, sin = rope_tables(cfg, attn.positions, params["model.embed_tokens.weight"].dtype)

    def attention(i: int, x: torch.Tensor) -> torch.Tensor:
        return attention_block(params, cfg, i, x, cos, sin, attn)

    def mlp(i: int, x: torch.Tensor) -> torch.Tensor:
        return mlp_dense(params, f"model.layers.{i}.mlp.", x)

    return pre_norm_decoder(params, cfg, tokens, attention, mlp, logits_index=logits_index,
                            hidden_layers=hidden_layers)


def rope_tables(cfg: Qwen3Config, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim / 2] in ``dtype`` for positions [T] (the family's RoPE, default or YaRN)."""
    inv_freq, att_factor = rope_inv_freq(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
    return rope_cos_sin(positions, inv_freq, att_factor, dtype)


def attention_block(p: dict[str, torch.Tensor], cfg: Qwen3Config, layer: int, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, attn: Attention) -> torch.Tensor:
    """Qwen3 self-attention of one layer: GQA with per-head q/k RMSNorm, half-split RoPE, o_proj.

    x: [T, H] after input_layernorm; cos, sin: [T, head_dim/2]. Calls
    ``attn(layer, q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd], head_dim**-0.5)``.
    Returns [T, H]. Qwen3-MoE runs the same block.
    """
    t, hd, eps = x.shape[0], cfg.head_dim, cfg.rms_norm_eps
    pre = f"model.layers.{layer}.self_attn."
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads  # explicit: a rank may hold T = 0 tokens
    q = _linear(x, p, pre + "q_proj").view(t, hq, hd)  # [T, Hq, hd]
    k = _linear(x, p, pre + "k_proj").view(t, hkv, hd)  # [T, Hkv, hd]
    v = _linear(x, p, pre + "v_proj").view(t, hkv, hd)  # [T, Hkv, hd]
    q = rope_half(rms_norm(q, p[pre + "q_norm.weight"], eps), cos, sin)
    k = rope_half(rms_norm(k, p[pre + "k_norm.weight"], eps), cos, sin)
    o = attn(layer, q, k, v, hd**-0.5)  # [T, Hq, hd]
    return _linear(o.reshape(t, hq * hd), p, pre + "o_proj")


def _linear(x: torch.Tensor, p: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, p[name + ".weight"], p.get(name + ".bias"))


def init_params(cfg: Qwen3Config, *, seed: int = 0, std: float = 0.02, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random parameters with the Hugging Face names (normal(0, std); norms at 1). For demos and tests.

    >>> cfg = Qwen3Config(vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
    ...                   num_attention_heads=2, num_key_value_heads=1, head_dim=2)
    >>> init_params(cfg)["model.layers.0.mlp.down_proj.weight"].shape
    torch.Size([4, 8])
    """
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    hs, im = cfg.hidden_size, cfg.intermediate_size

    def mlp(i: int) -> dict[str, torch.Tensor]:
        m = f"model.layers.{i}.mlp."
        return {m + "gate_proj.weight": rnd(im, hs), m + "up_proj.weight": rnd(im, hs),
                m + "down_proj.weight": rnd(hs, im)}

    return init_layers(cfg, rnd, dtype, mlp)


def init_layers(cfg: Qwen3Config, rnd, dtype: torch.dtype, mlp) -> dict[str, torch.Tensor]:
    """Embeddings, norms, lm_head and every layer's attention weights, then ``mlp(i)``'s (layer by layer).

    ``rnd(*shape)`` draws a random tensor; ``mlp(i)`` returns layer i's MLP
    weights (dense or MoE), drawn right after that layer's attention.
    """
    hq, hkv, hd, hs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
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
        })
        if cfg.attention_bias:  # zero biases (no draw: the random weights stay those of the bias-free model)
            a = pre + "self_attn."
            p.update({a + "q_proj.bias": torch.zeros(hq * hd, dtype=dtype), a + "k_proj.bias": torch.zeros(hkv * hd,
                      dtype=dtype), a + "v_proj.bias": torch.zeros(hkv * hd, dtype=dtype),
                      a + "o_proj.bias": torch.zeros(hs, dtype=dtype)})
        p.update(mlp(i))
    return p


def kv_layouts(cfg: Qwen3Config) -> tuple[KVLayout, ...]:
    """One GQA cache row per layer: ``num_key_value_heads`` keys and values of ``head_dim``."""
    return (KVLayout(cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim),) * cfg.num_hidden_layers


FAMILY = ModelFamily(name="qwen3", config_class=Qwen3Config, attention="gqa", forward=forward,
                     init_params=init_params, kv_layouts=kv_layouts, capturable=True,
                     draft_target=gqa_target)
