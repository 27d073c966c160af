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

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from cpattn.models.family import KVLayout, ModelFamily
from cpattn.models.common import (
    Attention,
    config_dict,
    mlp_dense,
    pre_norm_decoder,
    rope_cos_sin,
    rope_inv_freq,
    rope_parameters,
    yarn_mscale,
)
from cpattn.models.checks import bad, check_at_most, check_choices, check_divides, check_fields, check_rope
from cpattn.models.moe import MOE_IMPLS, moe_experts, sigmoid_route
from cpattn.ops.mla_preprocess import mla_chain, mla_preprocess, mla_weights

# the query- and kv-latent RMSNorms use this eps whatever rms_norm_eps says (as the reference builds them)
LATENT_NORM_EPS = 1e-6

# config.json fields as they must be (cpattn.models.checks.check_fields); "?": may be absent or null
CONFIG_RULES = {
    "vocab_size": "int>0", "hidden_size": "int>0", "intermediate_size": "int>0", "num_hidden_layers": "int>0",
    "num_attention_heads": "int>0", "moe_intermediate_size": "int>0?", "kv_lora_rank": "int>0",
    "q_lora_rank": "int>0?", "qk_nope_head_dim": "int>0", "qk_rope_head_dim": "int>0", "v_head_dim": "int>0",
    "n_routed_experts": "int>=0?", "n_shared_experts": "int>=0?", "num_experts_per_tok": "int>=0?",
    "n_group": "int>0?", "topk_group": "int>0?", "routed_scaling_factor": "num>0?",
    "first_k_dense_replace": "int>=0?", "norm_topk_prob": "bool?", "rms_norm_eps": "num>0?",
    "rope_interleave": "bool?", "max_position_embeddings": "int>0?", "tie_word_embeddings": "bool?",
    "attention_bias": "bool?", "mlp_layer_types": "strs?",
}


def check_config(d: dict) -> None:
    """The DeepSeek-V3 trunk's config.json fields (V2, V3.2 and GLM-5 too): types, then the relations
    between them (experts per token, groups dividing the experts, an even RoPE width, one MLP type per layer).

    >>> check_config({"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
    ...               "num_attention_heads": 2, "kv_lora_rank": 4, "qk_nope_head_dim": 4, "qk_rope_head_dim": 3,
    ...               "v_head_dim": 4})
    Traceback (most recent call last):
    ...
    cpattn.models.checks.ConfigFieldError: config field 'qk_rope_head_dim' is 3; expected an even number (RoPE rotates pairs)
    """
    check_fields(d, CONFIG_RULES)
    if d["qk_rope_head_dim"] % 2:
        raise bad("qk_rope_head_dim", d["qk_rope_head_dim"], "an even number (RoPE rotates pairs)")
    if d.get("n_routed_experts"):
        check_at_most(d, "num_experts_per_tok", "n_routed_experts")
        if not d.get("num_experts_per_tok"):
            raise bad("num_experts_per_tok", d.get("num_experts_per_tok"),
                      f"1..{d['n_routed_experts']} (experts per token)")
        check_divides(d, "n_group", "n_routed_experts")
        check_at_most(d, "topk_group", "n_group")
    check_choices(d, "mlp_layer_types", ("dense", "sparse"), length=d["num_hidden_layers"])
    check_rope(rope_parameters(d))


@dataclass(frozen=True)
class DeepseekV3Config:
    """The DeepSeek-V3 hyper-parameters the forward pass reads (names as in config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]  # "dense" or "sparse" per layer
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    moe_impl: str = "auto"  # routed experts: "auto" | "sparse" | "dense" (see cpattn.models.moe.use_dense)
    # MLAPO: where the step offers a paged latent cache (DCP decode), project and write it in one fused op
    mla_preprocess: bool = True

    # RoPE on the query/key rope dims in (at least) float32 whatever the activations' dtype (DeepSeek-V2 does)
    rope_float32: ClassVar[bool] = False

    def __post_init__(self):
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}; got {self.moe_impl!r}")

    @classmethod
    def from_hf(cls, config: Any) -> DeepseekV3Config:
        """From a transformers config (DeepSeek-V3 or -V3.2), a config.json dict, or a checkpoint path."""
        d = config_dict(config)
        check_config(d)
        if d.get("attention_bias"):
            raise ValueError("attention_bias=True is not supported by cpattn.models.deepseek_v3")
        n = d["num_hidden_layers"]
        types = d.get("mlp_layer_types")
        if not types:
            k = min(d.get("first_k_dense_replace") or 0, n)
            types = ["dense"] * k + ["sparse"] * (n - k)
            if not d.get("n_routed_experts"):
                types = ["dense"] * n
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            moe_intermediate_size=d.get("moe_intermediate_size") or d["intermediate_size"],
            num_hidden_layers=n,
            num_attention_heads=d["num_attention_heads"],
            kv_lora_rank=d["kv_lora_rank"],
            q_lora_rank=d.get("q_lora_rank"),
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            n_routed_experts=d.get("n_routed_experts") or 0,
            n_shared_experts=d.get("n_shared_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok") or 0,
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            mlp_layer_types=tuple(types),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope=rope_parameters(d),
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )

    def to_hf(self) -> dict:
        """The config.json dict (transformers' field names) that :meth:`from_hf` reads back equal; the
        runtime switches ``moe_impl`` and ``mla_preprocess`` are not written.

        >>> cfg = DeepseekV3Config.tiny()
        >>> DeepseekV3Config.from_hf(cfg.to_hf()) == cfg, cfg.to_hf()["first_k_dense_replace"]
        (True, 1)
        """
        d = {k: v for k, v in asdict(self).items() if k not in ("rope", "moe_impl", "mla_preprocess")}
        dense = next((i for i, t in enumerate(self.mlp_layer_types) if t != "dense"), self.num_hidden_layers)
        return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **d,
                "mlp_layer_types": list(self.mlp_layer_types), "first_k_dense_replace": dense,
                "num_key_value_heads": self.num_attention_heads, "rope_parameters": dict(self.rope),
                "num_nextn_predict_layers": 0}

    @classmethod
    def tiny(cls, **over) -> DeepseekV3Config:
        """A tiny test/demo configuration (2 layers, hidden 64, 4 experts, vocab 64)."""
        base = dict(
            vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, mlp_layer_types=("dense", "sparse"),
        )
        base.update(over)
        return cls(**base)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2`` under YaRN."""
        scale = self.qk_head_dim**-0.5
        if self.rope.get("rope_type", "default") != "default" and self.rope.get("mscale_all_dim"):
            m = yarn_mscale(self.rope["factor"], self.rope["mscale_all_dim"])
            scale = scale * m * m
        return scale


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
                     init_params=init_params, kv_layouts=kv_layouts, capturable=True)
