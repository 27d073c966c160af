"""DeepSeek-V2 (MLA attention, DeepSeek MoE with a softmax router) as a pure function.

The trunk is DeepSeek-V3's (:func:`cpattn.models.deepseek_v3.decoder`:
absorbed MLA over a latent cache ``[c | k_rope]``, dense layers below
``first_k_dense_replace``, routed + shared experts above). What differs
from V3, as transformers' ``deepseek_v2`` computes it:

- router: ``softmax(x @ gate^T)`` in float32 (no correction bias), then
  ``topk_method`` "greedy" (top-k of all experts) or "group_limited_greedy"
  (only the ``topk_group`` groups whose best expert scores highest; other
  experts score 0), weights times ``routed_scaling_factor``. The weights
  are never renormalized: ``norm_topk_prob`` is ignored (released V2
  checkpoints set it False);
- RoPE always on interleaved pairs (2i, 2i+1), rotated in float32 whatever
  the activations' dtype;
- ``moe_layer_freq`` other than 1 is refused (transformers ignores it).

Shared with V3: q LoRA (``q_lora_rank``) or a plain ``q_proj`` (V2-Lite),
RoPE ``default`` or ``yarn`` (cos/sin scaled by the YaRN attention factor
and the softmax scale by ``mscale(factor, mscale_all_dim)**2``), the
latent norms' eps of 1e-6, the legacy cache helpers.

Example
-------
>>> import torch
>>> from cpattn.engine.dense_cache import DenseKVCache
>>> from cpattn.models import deepseek_v2 as ds
>>> cfg = ds.DeepseekV2Config.tiny()
>>> params = ds.init_params(cfg, seed=0)
>>> step = DenseKVCache.empty(ds.FAMILY.kv_layouts(cfg), batch=1, max_len=8).step([4])
>>> ds.forward(params, cfg, torch.tensor([1, 2, 3, 4]), step).shape
torch.Size([4, 64])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cpattn.models.draft_target import mla_target
from cpattn.models.family import ModelFamily
from cpattn.models import deepseek_v3 as v3
from cpattn.models.checks import bad, check_fields
from cpattn.models.common import Attention, config_dict, mlp_dense
from cpattn.models.moe import softmax_route

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekV2Config(v3.DeepseekV3Config):
    """DeepSeek-V3's fields (``norm_topk_prob`` always False) plus ``topk_method``.

    With "greedy", ``n_group = topk_group = 1`` (no group limit).
    """

    topk_method: str = "greedy"

    rope_float32: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}; got {self.topk_method!r}")
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} does not divide n_routed_experts={self.n_routed_experts}")

    @classmethod
    def from_hf(cls, config: Any) -> DeepseekV2Config:
        """From a transformers ``DeepseekV2Config``, a config.json dict, or a checkpoint path.

        >>> d = dict(model_type="deepseek_v2", vocab_size=8, hidden_size=8, intermediate_size=8,
        ...          num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=4, q_lora_rank=None,
        ...          qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, n_routed_experts=4,
        ...          num_experts_per_tok=2, first_k_dense_replace=1, topk_method="greedy", n_group=2)
        >>> cfg = DeepseekV2Config.from_hf(d)
        >>> cfg.mlp_layer_types, cfg.n_group, cfg.q_lora_rank
        (('dense', 'sparse'), 1, None)
        """
        d = config_dict(config)
        if d.get("model_type", "deepseek_v2") != "deepseek_v2":
            raise ValueError(f"model_type is {d.get('model_type')!r}; cpattn.models.deepseek_v2 expects 'deepseek_v2'")
        check_fields(d, {"topk_method": "str?", "moe_layer_freq": "int>0?", "mlp_bias": "bool?"})
        if (d.get("moe_layer_freq") or 1) != 1:
            raise ValueError(f"moe_layer_freq={d['moe_layer_freq']} is not supported (transformers' DeepSeek-V2 "
                             "ignores it: every layer from first_k_dense_replace on is MoE); use 1")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported by cpattn.models.deepseek_v2")
        method = d.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise bad("topk_method", method, f"one of {TOPK_METHODS}")
        # greedy routing has no groups: the group fields are not read (and need not divide the experts)
        plain = {**d, "n_group": None, "topk_group": None} if method == "greedy" else d
        base = dataclasses.asdict(v3.DeepseekV3Config.from_hf(plain))
        base.update(rope_interleave=True, norm_topk_prob=False, topk_method=method)
        if method == "greedy":
            base.update(n_group=1, topk_group=1)
        return cls(**base)

    def to_hf(self) -> dict:
        """The config.json dict that :meth:`from_hf` reads back equal.

        >>> cfg = DeepseekV2Config.tiny()
        >>> DeepseekV2Config.from_hf(cfg.to_hf()) == cfg
        True
        """
        return {**super().to_hf(), "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"]}

    @classmethod
    def tiny(cls, **over) -> DeepseekV2Config:
        """A tiny test/demo configuration (DeepSeek-V3's tiny one with V2's router: group-limited, scaled)."""
        base = dataclasses.asdict(v3.DeepseekV3Config.tiny())
        base.update(norm_topk_prob=False, topk_method="group_limited_greedy")
        base.update(over)
        return cls(**base)


# legacy, removed when the engine lands: today's generate() builds caches through it


def mlp(p: dict[str, torch.Tensor], cfg: DeepseekV2Config, layer: int, x: torch.Tensor) -> torch.Tensor:
    """The layer's dense SwiGLU MLP or its MoE block (softmax router, routed + shared experts). x: [T, H] -> [T, H]."""
    pre = f"model.layers.{layer}.mlp."
    if cfg.mlp_layer_types[layer] == "dense":
        return mlp_dense(p, pre, x)
    weights, experts = softmax_route(x, p[pre + "gate.weight"], top_k=cfg.num_experts_per_tok,
                                     routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group,
                                     topk_group=cfg.topk_group)
    return v3.deepseek_moe(p, cfg, pre, x, weights, experts)


def forward(
    params: dict[str, torch.Tensor],
    cfg: DeepseekV2Config,
    tokens: torch.Tensor,
    attn: Attention,
    *,
    logits_index: torch.Tensor | None = None,
    hidden_layers: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """Logits of one step's packed tokens (arguments as :func:`cpattn.models.deepseek_v3.forward`).

    tokens: [T] int64; attn: the step of a latent KV cache. Returns [T or
    T', V], or ``(logits, hidden)`` with ``hidden_layers``.
    """
    return v3.decoder(params, cfg, tokens, attn, v3.mla_attend, mlp=mlp, logits_index=logits_index,
                      hidden_layers=hidden_layers)


def init_params(cfg: DeepseekV2Config, *, seed: int = 0, std: float = 0.02,
                dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random parameters with the Hugging Face names (DeepSeek-V3's without the router bias). For demos and tests.

    >>> sorted(k for k in init_params(DeepseekV2Config.tiny()) if "layers.1.mlp.gate" in k)
    ['model.layers.1.mlp.gate.weight']
    """
    p = v3.init_params(cfg, seed=seed, std=std, dtype=dtype)
    return {k: t for k, t in p.items() if not k.endswith("e_score_correction_bias")}


FAMILY = ModelFamily(name="deepseek_v2", config_class=DeepseekV2Config, attention="mla", forward=forward,
                     init_params=init_params, kv_layouts=v3.kv_layouts, capturable=True,
                     draft_target=mla_target)
