"""DeepSeek-V3.2 (MLA + DeepSeek Sparse Attention) as a pure function.

DeepSeek-V3 (:mod:`cpattn.models.deepseek_v3`: absorbed MLA, exact MoE,
YaRN) plus a lightning indexer in every layer. For token t the indexer
scores every visible key s (``s <= pos_t``)::

    q_I[t] = wq_b(q_lora[t])            # [H_I, D_I], RoPE (half-split) on the first rope dims
    k_I[s] = LayerNorm(wk(x[s]))        # [D_I], RoPE likewise
    w[t]   = weights_proj(x[t]) * H_I**-0.5 * D_I**-0.5
    I[t,s] = sum_h w[t,h] * relu(q_I[t,h] . k_I[s])

and attention runs over the ``index_topk`` best keys only
(:func:`cpattn.dsa.dsa_attention`; ties go to the earlier key). The cache
holds, per token, the latent row ``[c | k_rope]`` and the indexer key.
The reference's Hadamard rotation and FP8 quantization of the indexer are
precision tricks left out here, as the Hugging Face port also does.

Supported: everything :mod:`cpattn.models.deepseek_v3` supports (always
q LoRA, interleaved MLA RoPE), per-layer ``mlp_layer_types``. Not supported:
GLM-5's cross-layer top-k sharing (``glm_moe_dsa``).

Example
-------
>>> import torch
>>> from cpattn.engine.dense_cache import DenseKVCache
>>> from cpattn.models import deepseek_v32 as ds
>>> cfg = ds.DeepseekV32Config.tiny()
>>> params = ds.init_params(cfg, seed=0)
>>> step = DenseKVCache.empty(ds.FAMILY.kv_layouts(cfg), batch=1, max_len=8).step([4])
>>> ds.forward(params, cfg, torch.tensor([1, 2, 3, 4]), step).shape
torch.Size([4, 64])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cpattn.models import deepseek_v3 as v3
from cpattn.models.draft_target import mla_target
from cpattn.models.family import KVLayout, ModelFamily
from cpattn.models.checks import check_fields
from cpattn.models.common import config_dict, rope_half


@dataclass(frozen=True)
class DeepseekV32Config(v3.DeepseekV3Config):
    """DeepSeek-V3 fields plus the indexer's: ``index_topk``, ``index_n_heads``, ``index_head_dim``."""

    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128

    @classmethod
    def from_hf(cls, config: Any) -> DeepseekV32Config:
        """From a transformers ``DeepseekV32Config``, a config.json dict, or a checkpoint path."""
        d = config_dict(config)
        base = v3.DeepseekV3Config.from_hf(d)
        check_fields(d, {"index_topk": "int>0", "index_n_heads": "int>0", "index_head_dim": "int>0"})
        if base.q_lora_rank is None:
            raise ValueError("DeepSeek-V3.2 needs q_lora_rank (the indexer reads the query latent); got None")
        return cls(**{**dataclasses.asdict(base), "rope_interleave": True},
                   index_topk=d["index_topk"], index_n_heads=d["index_n_heads"], index_head_dim=d["index_head_dim"])

    def to_hf(self) -> dict:
        """The config.json dict that :meth:`from_hf` reads back equal.

        >>> cfg = DeepseekV32Config.tiny()
        >>> DeepseekV32Config.from_hf(cfg.to_hf()) == cfg
        True
        """
        return {**super().to_hf(), "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"]}

    @classmethod
    def tiny(cls, **over) -> DeepseekV32Config:
        """A tiny test/demo configuration (DeepSeek-V3's tiny one plus 4 indexer heads of 16 dims, top-4)."""
        base = dataclasses.asdict(v3.DeepseekV3Config.tiny())
        base.update(index_topk=4, index_n_heads=4, index_head_dim=16)
        base.update(over)
        return cls(**base)


def indexer(p: dict[str, torch.Tensor], cfg: DeepseekV32Config, pre: str, x: torch.Tensor, q_lora: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, *, rope=rope_half) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lightning indexer's projections of one layer.

    x: [T, H] (after input_layernorm); q_lora: [T, q_lora_rank]; cos, sin: [T, rope/2];
    rope: how the first ``qk_rope_head_dim`` dims rotate (half-split here; GLM-5 interleaves).
    Returns q_index [T, H_I, D_I], w_index [T, H_I] (float32, constants folded in), k_index [T, D_I].
    ``weights_proj`` runs in its own (float32) dtype, as the reference keeps that module.
    """
    t, hi, di, rd = x.shape[0], cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = F.linear(q_lora, p[pre + "wq_b.weight"]).view(t, hi, di)  # [T, H_I, D_I]
    k = F.layer_norm(F.linear(x, p[pre + "wk.weight"]), (di,), p[pre + "k_norm.weight"], p[pre + "k_norm.bias"], 1e-6)
    q = torch.cat([rope(q[..., :rd], cos, sin), q[..., rd:]], dim=-1)  # rope dims first
    k = torch.cat([rope(k[:, None, :rd], cos, sin)[:, 0], k[:, rd:]], dim=-1)  # [T, D_I]
    wp = p[pre + "weights_proj.weight"]  # kept in float32 (at least), as the reference keeps the module
    w = F.linear(x.to(wp.dtype), wp).to(torch.promote_types(wp.dtype, torch.float32))
    w = w * (hi**-0.5 * di**-0.5)  # [T, H_I]
    return q, w, k


def forward(
    params: dict[str, torch.Tensor],
    cfg: DeepseekV32Config,
    tokens: torch.Tensor,
    attn: Any,
    *,
    logits_index: torch.Tensor | None = None,
    hidden_layers: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """Logits of one step's packed tokens (see :func:`cpattn.models.deepseek_v3.forward`).

    ``attn`` must offer ``attn.dsa(layer, q, kv, q_index, w_index, k_index,
    topk, scale)`` (every step of :mod:`cpattn.engine.dense_cache` and
    :mod:`cpattn.models.dcp_cache` does). tokens: [T]; returns [T or T', V],
    or ``(logits, hidden)`` with ``hidden_layers``.
    """
    return v3.decoder(params, cfg, tokens, attn, dsa_attend, logits_index=logits_index, hidden_layers=hidden_layers)


def dsa_attend(p: dict[str, torch.Tensor], cfg: DeepseekV32Config, pre: str, layer: int, x, q, kv, q_lora, cos, sin,
               attn: Any) -> torch.Tensor:
    """One layer's DSA: the indexer's q/w/k, then ``attn.dsa(...)`` (top-k + sparse MLA) -> [T, Hq, r]."""
    qi, wi, ki = indexer(p, cfg, pre + "indexer.", x, q_lora, cos, sin)
    return attn.dsa(layer, q, kv, qi, wi, ki, cfg.index_topk, cfg.softmax_scale)


def init_params(
    cfg: DeepseekV32Config, *, seed: int = 0, std: float = 0.02, dtype=torch.float32
) -> dict[str, torch.Tensor]:
    """Random parameters with the Hugging Face names (DeepSeek-V3's plus the indexer's). For demos and tests."""
    p = v3.init_params(cfg, seed=seed, std=std, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    hi, di, hs = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.self_attn.indexer."
        p[pre + "wq_b.weight"] = (torch.randn(hi * di, cfg.q_lora_rank, generator=g) * std).to(dtype)
        p[pre + "wk.weight"] = (torch.randn(di, hs, generator=g) * std).to(dtype)
        p[pre + "k_norm.weight"] = torch.ones(di, dtype=dtype)
        p[pre + "k_norm.bias"] = torch.zeros(di, dtype=dtype)
        p[pre + "weights_proj.weight"] = (torch.randn(hi, hs, generator=g) * std).to(
            torch.promote_types(dtype, torch.float32))  # float32 (or float64), as the reference keeps it
    return p


def kv_layouts(cfg: DeepseekV32Config) -> tuple[KVLayout, ...]:
    """The MLA latent row plus the indexer key (``index_head_dim``) per layer."""
    return (KVLayout(1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank, values_in_keys=True,
                     index_head_dim=cfg.index_head_dim),) * cfg.num_hidden_layers


FAMILY = ModelFamily(name="deepseek_v32", config_class=DeepseekV32Config, attention="dsa", forward=forward,
                     init_params=init_params, kv_layouts=kv_layouts, capturable=True,
                     draft_target=mla_target)
