"""DeepSeek-V3 (MLA attention, DeepSeek MoE) as a pure function.

MLA runs in the absorbed ("MQA") form for prefill and decode alike: the
cache holds one row per token, ``[c | k_rope]`` (``kv_lora_rank +
qk_rope_head_dim`` dims, 576 in DeepSeek-V3), which is the single key head;
values are its first ``kv_lora_rank`` dims. Per head h, ``W_UK[h]`` is
folded into the query and ``W_UV[h]`` applied after attention::

    q_lat[t,h]  = q_nope[t,h] @ W_UK[h]          # [kv_lora_rank]
    score[t,s]  = (q_lat[t,h] . c[s] + q_rope[t,h] . k_rope[s]) * scale
    out[t,h]    = (softmax(score) @ c) @ W_UV[h]^T   # [v_head_dim]

which equals the reference's expanded form (per-head keys and values built
from the latent). ``scale = qk_head_dim**-0.5``, times ``mscale**2`` under
YaRN with ``mscale_all_dim`` (DeepSeek-V3's released config).

Supported: q LoRA (``q_lora_rank``) or a plain ``q_proj``; interleaved or
half-split RoPE (``rope_interleave``); RoPE ``default`` and ``yarn``; dense
layers below ``first_k_dense_replace`` and MoE above, computed exactly
(sigmoid router with ``e_score_correction_bias``, group-limited top-k,
shared experts; one expert at a time). Not supported: FP8 checkpoints,
the multi-token-prediction layer (ignored), ``attention_bias``.

The configuration (:class:`DeepseekV3Config`, :func:`check_config`, :data:`CONFIG_RULES`) lives in
:mod:`cpattn.models.deepseek_v3_config` and is importable from here as before.

Example
-------
>>> import torch
>>> from cpattn.engine.dense_cache import DenseKVCache
>>> from cpattn.models import deepseek_v3 as ds
>>> cfg = ds.DeepseekV3Config.tiny()
>>> params = ds.init_params(cfg, seed=0)
>>> step = DenseKVCache.empty(ds.FAMILY.kv_layouts(cfg), batch=1, max_len=8).step([4])
>>> ds.forward(params, cfg, torch.tensor([1, 2, 3, 4]), step).shape
torch.Size([4, 64])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cpattn.models.draft_target import mla_target
from cpattn.models.family import KVLayout, ModelFamily
from cpattn.models.common import Attention, mlp_dense, pre_norm_decoder, rope_cos_sin, rope_inv_freq
from cpattn.models.deepseek_v3_config import CONFIG_RULES, DeepseekV3Config, check_config  # noqa: F401 (re-exported)
from cpattn.models.moe import moe_experts, sigmoid_route
from cpattn.ops.mla_preprocess import mla_chain, mla_preprocess, mla_weights

# the query- and kv-latent RMSNorms use this eps whatever rms_norm_eps says (as the reference builds them)
LATENT_NORM_EPS = 1e-6


def mla_project(
    p: dict[str, torch.Tensor], cfg: DeepseekV3Config, pre: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
):
    """MLA projections of one layer in absorbed form (:func:`cpattn.ops.mla_preprocess.mla_chain`).

    x: [T, H] (after input_layernorm); cos, sin: [T, rope/2] (float32 or
    wider when ``cfg.rope_float32``: the rope dims are rotated in that dtype).
    Returns (q [T, Hq, r + rope], kv [T, 1, r + rope], q_lora [T, q_lora_rank] or None)
    with r = kv_lora_rank; q_lora is the normalized query latent (the DSA
    indexer reads it). The latent norms use :data:`LATENT_NORM_EPS`.
    """
    q, kv, q_lora, _ = mla_chain(x, cos=cos, sin=sin, **_mla_args(p, cfg, pre))
    return q, kv, (q_lora if cfg.q_lora_rank is not None else None)


def _mla_args(p: dict[str, torch.Tensor], cfg: DeepseekV3Config, pre: str) -> dict:
    """Keyword arguments of the MLA chain / fused op for one layer (input already normed), but cos / sin."""
    w = mla_weights(p, pre, num_heads=cfg.num_attention_heads, qk_nope_head_dim=cfg.qk_nope_head_dim,
                    v_head_dim=cfg.v_head_dim)
    return dict(w, input_norm_weight=None, eps=cfg.rms_norm_eps,
                rope_interleave=cfg.rope_interleave, latent_eps=LATENT_NORM_EPS)


def _mla_fused(p: dict[str, torch.Tensor], cfg: DeepseekV3Config, pre: str, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor):
    """:func:`mla_project` that also writes the latent rows at ``slots`` [T] of the paged ``cache`` (MLAPO).
    Returns (q, None, q_lora or None): the step reads its rows from the cache."""
    out = mla_preprocess(x, cache, slots, cos, sin, **_mla_args(p, cfg, pre))
    return out.q, None, (out.q_lora if cfg.q_lora_rank is not None else None)


def mla_output(p: dict[str, torch.Tensor], cfg: DeepseekV3Config, pre: str, o_lat: torch.Tensor) -> torch.Tensor:
    """Latent attention output [T, Hq, r] -> o_proj output [T, H] via W_UV."""
    nh, nope, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    w_uv = p[pre + "kv_b_proj.weight"].view(nh, nope + cfg.v_head_dim, r)[:, nope:]  # [Hq, v, r]
    o = torch.einsum("thr,hvr->thv", o_lat, w_uv)  # [T, Hq, v]
    return F.linear(o.reshape(o.shape[0], nh * cfg.v_head_dim), p[pre + "o_proj.weight"])  # T may be 0


def mlp(p: dict[str, torch.Tensor], cfg: DeepseekV3Config, layer: int, x: torch.Tensor) -> torch.Tensor:
    """The layer's dense SwiGLU MLP or its MoE block (sigmoid router, routed + shared experts). x: [T, H] -> [T, H]."""
    pre = f"model.layers.{layer}.mlp."
    if cfg.mlp_layer_types[layer] == "dense":
        return mlp_dense(p, pre, x)
    weights, experts = sigmoid_route(
        x, p[pre + "gate.weight"], p[pre + "gate.e_score_correction_bias"], top_k=cfg.num_experts_per_tok,
        n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    return deepseek_moe(p, cfg, pre, x, weights, experts)


def deepseek_moe(p: dict[str, torch.Tensor], cfg: DeepseekV3Config, pre: str, x: torch.Tensor, weights: torch.Tensor,
                 experts: torch.Tensor) -> torch.Tensor:
    """Routed experts (``cfg.moe_impl``) plus the shared experts, given a router's choice.

    x: [T, H]; weights, experts: [T, k]; pre: ``model.layers.{i}.mlp.``. Returns [T, H].
    """
    y = moe_experts(x, weights, experts, p[pre + "experts.gate_up_proj"], p[pre + "experts.down_proj"],
                    impl=cfg.moe_impl)
    if cfg.n_shared_experts:
        y = y + mlp_dense(p, pre + "shared_experts.", x)
    return y


def forward(
    params: dict[str, torch.Tensor],
    cfg: DeepseekV3Config,
    tokens: torch.Tensor,
    attn: Attention,
    *,
    logits_index: torch.Tensor | None = None,
    hidden_layers: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """Logits of one step's packed tokens.

    Arguments
    ---------
    params: Hugging Face names -> tensors (routed experts stacked, see
        :func:`cpattn.models.common.normalize_params`).
    tokens: [T] int64; attn: the step of a latent KV cache (``attn.positions``
        [T] give RoPE positions); logits_index: optional [T'] rows to project;
    hidden_layers: optional layer indices; then ``(logits, hidden)`` is
        returned (see :func:`cpattn.models.common.pre_norm_decoder`).

    Returns
    -------
    logits: [T or T', vocab_size] (and ``hidden``).
    """
    return decoder(params, cfg, tokens, attn, mla_attend, logits_index=logits_index, hidden_layers=hidden_layers)


def mla_attend(p: dict[str, torch.Tensor], cfg: DeepseekV3Config, pre: str, layer: int, x, q, kv, q_lora, cos, sin,
               attn: Attention) -> torch.Tensor:
    """Dense absorbed MLA of one layer: ``attn(layer, q, kv, None, scale)`` -> [T, Hq, r]."""
    return attn(layer, q, kv, None, cfg.softmax_scale)


def decoder(params: dict[str, torch.Tensor], cfg: DeepseekV3Config, tokens: torch.Tensor, attn: Any,
            attend, *, mlp=mlp, logits_index: torch.Tensor | None = None,
            hidden_layers: tuple[int, ...] | None = None) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """The DeepSeek trunk shared by V2, V3 and V3.2: MLA + MoE/MLP layers in
    :func:`~cpattn.models.common.pre_norm_decoder`.

    ``attend(p, cfg, pre, layer, x, q, kv, q_lora, cos, sin, attn) -> o_lat [T, Hq, r]``
    is the attention part that differs (dense MLA here, DSA in V3.2);
    ``mlp(p, cfg, layer, x) -> [T, H]`` the MLP / MoE block (V2 routes by
    softmax). Returns [T or T', V], or ``(logits, hidden)`` with ``hidden_layers``.
    """
    p = params
    dtype = p["model.embed_tokens.weight"].dtype
    if cfg.rope_float32:
        dtype = torch.promote_types(dtype, torch.float32)
    inv_freq, att_factor = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings)
    cos, sin = rope_cos_sin(attn.positions, inv_freq, att_factor, dtype)  # [T, rope/2]

    def attention(i: int, x: torch.Tensor) -> torch.Tensor:
        pre = f"model.layers.{i}.self_attn."
        fused = attn.fused_cache(i) if cfg.mla_preprocess and hasattr(attn, "fused_cache") else None
        if fused is None:
            q, kv, q_lora = mla_project(p, cfg, pre, x, cos, sin)
        else:  # kv None: already in the step's cache
            q, kv, q_lora = _mla_fused(p, cfg, pre, x, cos, sin, *fused)
        o_lat = attend(p, cfg, pre, i, x, q, kv, q_lora, cos, sin, attn)  # [T, Hq, r]
        return mla_output(p, cfg, pre, o_lat)

    def block(i: int, x: torch.Tensor) -> torch.Tensor:
        return mlp(p, cfg, i, x)

    return pre_norm_decoder(p, cfg, tokens, attention, block, logits_index=logits_index, hidden_layers=hidden_layers)


def init_params(
    cfg: DeepseekV3Config, *, seed: int = 0, std: float = 0.02, dtype=torch.float32
) -> dict[str, torch.Tensor]:
    """Random parameters with the Hugging Face names (normal(0, std); norms at 1). For demos and tests."""
    g = torch.Generator().manual_seed(seed)
    hs, nh, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def ones(n):
        return torch.ones(n, dtype=dtype)

    p = {"model.embed_tokens.weight": rnd(cfg.vocab_size, hs), "model.norm.weight": ones(hs)}
    if not cfg.tie_word_embeddings:
        p["lm_head.weight"] = rnd(cfg.vocab_size, hs)
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        p[f"model.layers.{i}.input_layernorm.weight"] = ones(hs)
        p[f"model.layers.{i}.post_attention_layernorm.weight"] = ones(hs)
        if cfg.q_lora_rank is None:
            p[a + "q_proj.weight"] = rnd(nh * cfg.qk_head_dim, hs)
        else:
            p[a + "q_a_proj.weight"] = rnd(cfg.q_lora_rank, hs)
            p[a + "q_a_layernorm.weight"] = ones(cfg.q_lora_rank)
            p[a + "q_b_proj.weight"] = rnd(nh * cfg.qk_head_dim, cfg.q_lora_rank)
        p[a + "kv_a_proj_with_mqa.weight"] = rnd(r + cfg.qk_rope_head_dim, hs)
        p[a + "kv_a_layernorm.weight"] = ones(r)
        p[a + "kv_b_proj.weight"] = rnd(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r)
        p[a + "o_proj.weight"] = rnd(hs, nh * cfg.v_head_dim)
        if cfg.mlp_layer_types[i] == "dense":
            im = cfg.intermediate_size
            p.update({m + "gate_proj.weight": rnd(im, hs), m + "up_proj.weight": rnd(im, hs),
                      m + "down_proj.weight": rnd(hs, im)})
        else:
            e, im = cfg.n_routed_experts, cfg.moe_intermediate_size
            p[m + "gate.weight"] = rnd(e, hs).float()
            p[m + "gate.e_score_correction_bias"] = torch.zeros(e)
            p[m + "experts.gate_up_proj"] = rnd(e, 2 * im, hs)
            p[m + "experts.down_proj"] = rnd(e, hs, im)
            if cfg.n_shared_experts:
                sm = im * cfg.n_shared_experts
                s = m + "shared_experts."
                p.update({s + "gate_proj.weight": rnd(sm, hs), s + "up_proj.weight": rnd(sm, hs),
                          s + "down_proj.weight": rnd(hs, sm)})
    return p


def kv_layouts(cfg: DeepseekV3Config) -> tuple[KVLayout, ...]:
    """One MLA latent row per layer: ``[latent kv_lora_rank | rope key]``, values its first kv_lora_rank dims."""
    return (KVLayout(1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank, values_in_keys=True),) \
        * cfg.num_hidden_layers


FAMILY = ModelFamily(name="deepseek_v3", config_class=DeepseekV3Config, attention="mla", forward=forward,
                     init_params=init_params, kv_layouts=kv_layouts, capturable=True,
                     draft_target=mla_target)
