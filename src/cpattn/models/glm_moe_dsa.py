"""GLM-5 (``glm_moe_dsa``: MLA + DeepSeek Sparse Attention with top-k shared across layers) as a pure function.

The trunk is DeepSeek-V3's (:func:`cpattn.models.deepseek_v3.decoder`:
absorbed MLA over a latent cache ``[c | k_rope]``, interleaved MLA RoPE,
latent norms at eps 1e-6 whatever ``rms_norm_eps`` says, dense layers below
``first_k_dense_replace`` and sigmoid-routed MoE above). The attention is
DeepSeek-V3.2's DSA (:mod:`cpattn.models.deepseek_v32`) with what
transformers' ``glm_moe_dsa`` does differently:

- the indexer's RoPE is **interleaved** (pairs ``2i, 2i+1``), on the first
  ``qk_rope_head_dim`` dims of its query and key, not half-split;
- ``weights_proj`` runs in float32 (the reference keeps that module in fp32);
  the score is ``sum_h w[t,h] * H_I**-0.5 * relu(q_I[t,h] . k_I[s] * D_I**-0.5)``,
  computed with both constants folded into ``w`` (positive constants never
  change the selection);
- every layer is ``"full"`` (runs its indexer) or ``"shared"`` (has no
  indexer weights and reuses the selection of the previous full layer),
  from ``indexer_types``, or ``index_topk_pattern`` ("F"/"S" per layer), or
  ``index_topk_freq`` / ``index_skip_topk_offset``; all full by default.
  Layer 0 must be full;
- defaults: ``rms_norm_eps`` 1e-5, ``n_group = topk_group = 1``,
  ``first_k_dense_replace`` 3, 32 indexer heads of 128 dims;
- the multi-token-prediction layer (``model.layers.{num_hidden_layers}``,
  layer 78 of the release) is not used.

A full layer calls ``attn.dsa(..., return_selection=True)`` and keeps the
opaque selection it returns; a shared layer calls ``attn.dsa_shared(layer,
q, kv, selection, scale)``: no indexer, no indexer-key cache (its
:class:`~cpattn.models.family.KVLayout` has ``index_head_dim = 0``), and
under DCP no top-k exchange (each rank keeps the part of the selection in
its own shard).

Example
-------
>>> import torch
>>> from cpattn.engine.dense_cache import DenseKVCache
>>> cfg = GlmMoeDsaConfig.tiny()
>>> cfg.indexer_types
('full', 'shared', 'shared', 'full')
>>> params = init_params(cfg, seed=0)
>>> step = DenseKVCache.empty(kv_layouts(cfg), batch=1, max_len=8).step([5])
>>> forward(params, cfg, torch.tensor([1, 2, 3, 4, 5]), step).shape
torch.Size([5, 64])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.models.draft_target import DraftTarget, mla_target
from cpattn.models.family import KVLayout, ModelFamily
from cpattn.models import deepseek_v3 as v3
from cpattn.models import deepseek_v32 as v32
from cpattn.models.checks import check_choices, check_fields
from cpattn.models.common import config_dict, rope_interleaved

INDEXER_TYPES = ("full", "shared")
# transformers' GlmMoeDsaConfig defaults where they differ from what DeepSeek-V3's loader assumes
HF_DEFAULTS = dict(rms_norm_eps=1e-5, n_group=1, topk_group=1, first_k_dense_replace=3, index_topk=2048,
                   index_n_heads=32, index_head_dim=128, n_routed_experts=256, n_shared_experts=1,
                   num_experts_per_tok=8, routed_scaling_factor=2.5, norm_topk_prob=True)


def indexer_types_of(d: dict) -> tuple[str, ...]:
    """Per-layer ``"full"`` / ``"shared"`` of a config dict, as transformers derives them.

    ``indexer_types`` if given; else ``index_topk_pattern`` ("F"/"S" per layer, or
    a list); else layer i is full iff ``max(i - offset + 1, 0) % freq == 0`` with
    ``freq = index_topk_freq`` (default 1: all full) and ``offset =
    index_skip_topk_offset`` (default 2).

    >>> indexer_types_of({"num_hidden_layers": 6, "index_topk_freq": 3})
    ('full', 'full', 'shared', 'shared', 'full', 'shared')
    >>> indexer_types_of({"num_hidden_layers": 3, "index_topk_pattern": "FSF"})
    ('full', 'shared', 'full')
    """
    if d.get("indexer_types") is not None:
        return tuple(d["indexer_types"])
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            bad = sorted(set(pattern) - {"F", "S"})
            if bad:
                raise ValueError(f"index_topk_pattern {pattern!r} has {bad}; use 'F' (full) and 'S' (shared)")
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    freq = max(d.get("index_topk_freq") or 1, 1)
    offset = d.get("index_skip_topk_offset", 2)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(d["num_hidden_layers"]))


@dataclass(frozen=True)
class GlmMoeDsaConfig(v32.DeepseekV32Config):
    """DeepSeek-V3.2's fields plus ``indexer_types`` ("full" or "shared" per layer)."""

    indexer_types: tuple[str, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        types = self.indexer_types
        if len(types) != self.num_hidden_layers or any(t not in INDEXER_TYPES for t in types):
            raise ValueError(f"indexer_types must give one of {INDEXER_TYPES} per layer ({self.num_hidden_layers}); "
                             f"got {types!r}")
        if types[0] != "full":
            raise ValueError("indexer_types[0] is 'shared' but a shared layer reuses the selection of an earlier "
                             "full layer; make layer 0 'full'")

    @classmethod
    def from_hf(cls, config: Any) -> GlmMoeDsaConfig:
        """From a transformers ``GlmMoeDsaConfig``, a config.json dict, or a checkpoint path.

        >>> d = dict(model_type="glm_moe_dsa", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4,
        ...          num_attention_heads=2, kv_lora_rank=4, q_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2,
        ...          v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2, index_topk_pattern="FSSF")
        >>> cfg = GlmMoeDsaConfig.from_hf(d)
        >>> cfg.indexer_types, cfg.rms_norm_eps, cfg.mlp_layer_types
        (('full', 'shared', 'shared', 'full'), 1e-05, ('dense', 'dense', 'dense', 'sparse'))
        """
        d = {**HF_DEFAULTS, **{k: v for k, v in config_dict(config).items() if v is not None}}
        if d.get("model_type", "glm_moe_dsa") != "glm_moe_dsa":
            raise ValueError(f"model_type is {d.get('model_type')!r}; cpattn.models.glm_moe_dsa expects 'glm_moe_dsa'")
        check_fields(d, {"index_topk_freq": "int>0?", "index_skip_topk_offset": "int>=0?", "mlp_bias": "bool?"})
        check_choices(d, "indexer_types", INDEXER_TYPES, length=d.get("num_hidden_layers"))
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported by cpattn.models.glm_moe_dsa")
        base = dataclasses.asdict(v32.DeepseekV32Config.from_hf(d))
        return cls(**base, indexer_types=indexer_types_of(d))

    def to_hf(self) -> dict:
        """The config.json dict that :meth:`from_hf` reads back equal.

        >>> cfg = GlmMoeDsaConfig.tiny()
        >>> GlmMoeDsaConfig.from_hf(cfg.to_hf()) == cfg, cfg.to_hf()["indexer_types"]
        (True, ['full', 'shared', 'shared', 'full'])
        """
        return {**super().to_hf(), "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
                "indexer_types": list(self.indexer_types)}

    @classmethod
    def tiny(cls, **over) -> GlmMoeDsaConfig:
        """A tiny test/demo configuration: 4 layers (full, shared, shared, full), 32 indexer heads, top-4.

        32 indexer heads keep exact score ties (all-zero ReLU sums) out of the
        selection, so the greedy reference is well defined.
        """
        base = dataclasses.asdict(v3.DeepseekV3Config.tiny())
        base.update(num_hidden_layers=4, mlp_layer_types=("dense", "sparse", "dense", "sparse"), rms_norm_eps=1e-5,
                    n_group=1, topk_group=1, index_topk=4, index_n_heads=32, index_head_dim=16,
                    indexer_types=("full", "shared", "shared", "full"))
        base.update(over)
        return cls(**base)


def indexer(p: dict[str, torch.Tensor], cfg: GlmMoeDsaConfig, pre: str, x: torch.Tensor, q_lora: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GLM-5's indexer projections of one full layer (interleaved RoPE, float32 head weights).

    x: [T, H] (after input_layernorm); q_lora: [T, q_lora_rank]; cos, sin: [T, rope/2].
    Returns q_index [T, H_I, D_I], w_index [T, H_I] float32 (``H_I**-0.5 * D_I**-0.5``
    folded in), k_index [T, D_I].

    >>> cfg = GlmMoeDsaConfig.tiny()
    >>> p = init_params(cfg)
    >>> cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    >>> q, w, k = indexer(p, cfg, "model.layers.0.self_attn.indexer.", torch.randn(3, 64), torch.randn(3, 48), cos, sin)
    >>> q.shape, w.dtype, k.shape
    (torch.Size([3, 32, 16]), torch.float32, torch.Size([3, 16]))
    """
    return v32.indexer(p, cfg, pre, x, q_lora, cos, sin, rope=rope_interleaved)


def forward(
    params: dict[str, torch.Tensor],
    cfg: GlmMoeDsaConfig,
    tokens: torch.Tensor,
    attn: Any,
    *,
    logits_index: torch.Tensor | None = None,
    hidden_layers: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """Logits of one step's packed tokens (arguments as :func:`cpattn.models.deepseek_v3.forward`).

    ``attn`` must offer ``attn.dsa(layer, q, kv, q_index, w_index, k_index,
    topk, scale, return_selection=True) -> (out, selection)`` and
    ``attn.dsa_shared(layer, q, kv, selection, scale) -> out`` (every engine
    step does). tokens: [T]; returns [T or T', V], or ``(logits, hidden)``
    with ``hidden_layers``.
    """
    carry: dict[str, Any] = {}  # the selection of the last full layer, for the shared layers after it
    types = cfg.indexer_types

    def attend(p, cfg, pre, layer, x, q, kv, q_lora, cos, sin, attn):  # -> [T, Hq, r]
        if types[layer] == "shared":
            return attn.dsa_shared(layer, q, kv, carry["selection"], cfg.softmax_scale)
        qi, wi, ki = indexer(p, cfg, pre + "indexer.", x, q_lora, cos, sin)
        if layer + 1 == len(types) or types[layer + 1] == "full":  # nobody reuses this selection
            return attn.dsa(layer, q, kv, qi, wi, ki, cfg.index_topk, cfg.softmax_scale)
        out, carry["selection"] = attn.dsa(layer, q, kv, qi, wi, ki, cfg.index_topk, cfg.softmax_scale,
                                           return_selection=True)
        return out

    return v3.decoder(params, cfg, tokens, attn, attend, logits_index=logits_index, hidden_layers=hidden_layers)


def init_params(cfg: GlmMoeDsaConfig, *, seed: int = 0, std: float = 0.02,
                dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random parameters with the Hugging Face names; indexer weights on full layers only. For demos and tests.

    >>> p = init_params(GlmMoeDsaConfig.tiny())
    >>> w = p["model.layers.0.self_attn.indexer.weights_proj.weight"]
    >>> sorted({k.split(".")[2] for k in p if ".indexer." in k}), w.dtype
    (['0', '3'], torch.float32)
    """
    p = v3.init_params(cfg, seed=seed, std=std, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    hi, di, hs = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    for i, kind in enumerate(cfg.indexer_types):
        if kind == "shared":
            continue
        pre = f"model.layers.{i}.self_attn.indexer."
        p[pre + "wq_b.weight"] = (torch.randn(hi * di, cfg.q_lora_rank, generator=g) * std).to(dtype)
        p[pre + "wk.weight"] = (torch.randn(di, hs, generator=g) * std).to(dtype)
        p[pre + "k_norm.weight"] = torch.ones(di, dtype=dtype)
        p[pre + "k_norm.bias"] = torch.zeros(di, dtype=dtype)
        p[pre + "weights_proj.weight"] = torch.randn(hi, hs, generator=g) * std  # float32, as the reference keeps it
    return p


def kv_layouts(cfg: GlmMoeDsaConfig) -> tuple[KVLayout, ...]:
    """The MLA latent row per layer, plus the indexer key on full layers only (shared layers keep none).

    >>> [lay.row_width for lay in kv_layouts(GlmMoeDsaConfig.tiny())]
    [56, 40, 40, 56]
    """
    return tuple(KVLayout(1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank, values_in_keys=True,
                          index_head_dim=cfg.index_head_dim if kind == "full" else 0)
                 for kind in cfg.indexer_types)


def kv_bytes_per_token(cfg: GlmMoeDsaConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Cache bytes one token leaves in a full layer and in a shared layer, and in the whole model.

    >>> kv_bytes_per_token(GlmMoeDsaConfig.tiny(), torch.float32)
    {'full': 224, 'shared': 160, 'model': 768, 'model_if_all_full': 896}
    """
    size = torch.empty(0, dtype=dtype).element_size()
    lays = kv_layouts(cfg)
    full = (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim) * size
    return {"full": full, "shared": (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size,
            "model": sum(lay.row_width for lay in lays) * size, "model_if_all_full": full * len(lays)}


def draft_target(cfg: GlmMoeDsaConfig) -> DraftTarget:
    """DeepSeek-V3.2's draft target; the MTP layer N also gains an indexer kind, its own ("full").

    >>> draft_target(GlmMoeDsaConfig.tiny()).mtp_layer
    {'mlp_layer_types': 'sparse', 'indexer_types': 'full'}
    """
    t = mla_target(cfg)
    return dataclasses.replace(t, mtp_layer={**t.mtp_layer, "indexer_types": "full"})


FAMILY = ModelFamily(name="glm_moe_dsa", config_class=GlmMoeDsaConfig, attention="dsa", forward=forward,
                     init_params=init_params, kv_layouts=kv_layouts, capturable=True,
                     draft_target=draft_target)
