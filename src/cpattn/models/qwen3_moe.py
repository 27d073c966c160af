"""Qwen3-MoE (Qwen3 attention, sparse mixture-of-experts MLPs) as a pure function.

The attention is Qwen3's (:func:`cpattn.models.qwen3.attention_block`: GQA
with per-head q/k RMSNorm, half-split RoPE). Each layer's MLP is either a
dense SwiGLU or a sparse MoE block with no shared expert::

    probs   = softmax(x @ gate^T)                    # [T, E], float32
    w, e    = top-k(probs)                           # [T, k]
    w       = w / sum(w)      if norm_topk_prob
    out[t]  = sum_j w[t, j] * expert_{e[t, j]}(x[t])

Layer i is MoE iff ``i not in mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0`` (and there are experts). The router matmul runs
in the activations' dtype and its weights are cast back to it, as the
reference does. Routed experts are summed by :func:`cpattn.models.moe.moe_experts`
(``moe_impl``: sparse loop in eager, dense and capturable while a graph is built).

Supported: everything :mod:`cpattn.models.qwen3` supports. Not supported:
sliding-window layers.

Example
-------
>>> import torch
>>> from cpattn.engine.dense_cache import DenseKVCache
>>> from cpattn.models import qwen3_moe
>>> cfg = qwen3_moe.Qwen3MoeConfig.tiny()
>>> params = qwen3_moe.init_params(cfg, seed=0)
>>> step = DenseKVCache.empty(qwen3_moe.FAMILY.kv_layouts(cfg), batch=1, max_len=8).step([3])
>>> qwen3_moe.forward(params, cfg, torch.tensor([1, 2, 3]), step).shape
torch.Size([3, 64])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cpattn.models.draft_target import gqa_target
from cpattn.models.family import ModelFamily
from cpattn.models import qwen3
from cpattn.models.checks import bad, check_at_most, check_fields
from cpattn.models.common import Attention, config_dict, mlp_dense, pre_norm_decoder
from cpattn.models.moe import MOE_IMPLS, moe_experts, softmax_route


# config.json fields as they must be, beyond Qwen3's (cpattn.models.checks.check_fields)
MOE_RULES = {"moe_intermediate_size": "int>0?", "num_experts": "int>=0?", "num_local_experts": "int>=0?",
             "num_experts_per_tok": "int>=0?", "decoder_sparse_step": "int>0?", "norm_topk_prob": "bool?",
             "mlp_only_layers": "ints?"}


@dataclass(frozen=True)
class Qwen3MoeConfig(qwen3.Qwen3Config):
    """Qwen3's fields plus the MoE ones (names as in config.json; ``mlp_layer_types`` derived).

    mlp_layer_types: "dense" or "sparse" per layer, from ``mlp_only_layers``
    and ``decoder_sparse_step``; moe_impl: "auto" | "sparse" | "dense"
    (see :func:`cpattn.models.moe.use_dense`).
    """

    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    mlp_layer_types: tuple[str, ...] = ()
    moe_impl: str = "auto"

    def __post_init__(self):
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries for "
                             f"{self.num_hidden_layers} layers; give one 'dense' or 'sparse' per layer")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}; got {self.moe_impl!r}")

    @classmethod
    def from_hf(cls, config: Any) -> Qwen3MoeConfig:
        """From a transformers ``Qwen3MoeConfig``, a config.json dict, or a checkpoint path.

        >>> d = dict(model_type="qwen3_moe", vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=4,
        ...          num_attention_heads=2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
        ...          mlp_only_layers=[3])
        >>> Qwen3MoeConfig.from_hf(d).mlp_layer_types
        ('dense', 'sparse', 'dense', 'dense')
        """
        d = config_dict(config)
        base = qwen3.qwen3_fields(d, "qwen3_moe")
        check_fields(d, MOE_RULES)
        n, experts = d["num_hidden_layers"], d.get("num_experts") or d.get("num_local_experts") or 0
        step, only = d.get("decoder_sparse_step") or 1, set(d.get("mlp_only_layers") or ())
        if experts:
            check_at_most(d, "num_experts_per_tok", "num_experts" if d.get("num_experts") else "num_local_experts")
            if not d.get("num_experts_per_tok"):
                raise bad("num_experts_per_tok", d.get("num_experts_per_tok"), f"1..{experts} (experts per token)")
        types = tuple("sparse" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense"
                      for i in range(n))
        return cls(**base, moe_intermediate_size=d.get("moe_intermediate_size") or d["intermediate_size"],
                   num_experts=experts, num_experts_per_tok=d.get("num_experts_per_tok") or 0,
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)), mlp_layer_types=types)

    def to_hf(self) -> dict:
        """The config.json dict that :meth:`from_hf` reads back equal (dense layers as ``mlp_only_layers``;
        ``moe_impl`` is a runtime switch, not written).

        >>> cfg = Qwen3MoeConfig.tiny()
        >>> Qwen3MoeConfig.from_hf(cfg.to_hf()) == cfg, cfg.to_hf()["mlp_only_layers"]
        (True, [1])
        """
        d = {k: v for k, v in super().to_hf().items() if k not in ("mlp_layer_types", "moe_impl")}
        return {**d, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, t in enumerate(self.mlp_layer_types) if t == "dense"]}

    @classmethod
    def tiny(cls, **over) -> Qwen3MoeConfig:
        """A tiny test/demo configuration (2 layers: MoE then dense; 6 query / 2 KV heads; 8 experts, top-2)."""
        base = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                    num_experts_per_tok=2, norm_topk_prob=True, mlp_layer_types=("sparse", "dense"))
        base.update(over)
        return cls(**base)


# legacy, removed when the engine lands: today's generate() builds caches through it


def mlp(p: dict[str, torch.Tensor], cfg: Qwen3MoeConfig, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s dense SwiGLU or its sparse MoE block. x: [T, H] -> [T, H]."""
    pre = f"model.layers.{layer}.mlp."
    if cfg.mlp_layer_types[layer] == "dense":
        return mlp_dense(p, pre, x)
    weights, experts = softmax_route(x, p[pre + "gate.weight"], top_k=cfg.num_experts_per_tok,
                                     norm_topk_prob=cfg.norm_topk_prob, logits_dtype=x.dtype)
    return moe_experts(x, weights.to(x.dtype), experts, p[pre + "experts.gate_up_proj"],
                       p[pre + "experts.down_proj"], impl=cfg.moe_impl)


def forward(
    params: dict[str, torch.Tensor],
    cfg: Qwen3MoeConfig,
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
    tokens: [T] int64; attn: the step of a KV cache (``attn.positions`` [T]);
    logits_index: optional [T'] rows to project; hidden_layers: optional
        layer indices, then ``(logits, hidden)`` is returned (see
        :func:`cpattn.models.common.pre_norm_decoder`).

    Returns
    -------
    logits: [T or T', vocab_size] (and ``hidden``).
    """
    cos, sin = qwen3.rope_tables(cfg, attn.positions, params["model.embed_tokens.weight"].dtype)

    def attention(i: int, x: torch.Tensor) -> torch.Tensor:
        return qwen3.attention_block(params, cfg, i, x, cos, sin, attn)

    def block(i: int, x: torch.Tensor) -> torch.Tensor:
        return mlp(params, cfg, i, x)

    return pre_norm_decoder(params, cfg, tokens, attention, block, logits_index=logits_index,
                            hidden_layers=hidden_layers)


def init_params(cfg: Qwen3MoeConfig, *, seed: int = 0, std: float = 0.02,
                dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random parameters with the Hugging Face names (experts stacked; norms at 1). For demos and tests.

    >>> p = init_params(Qwen3MoeConfig.tiny())
    >>> p["model.layers.0.mlp.experts.gate_up_proj"].shape, p["model.layers.0.mlp.gate.weight"].dtype
    (torch.Size([8, 64, 64]), torch.float32)
    """
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    hs = cfg.hidden_size

    def layer_mlp(i: int) -> dict[str, torch.Tensor]:
        m = f"model.layers.{i}.mlp."
        if cfg.mlp_layer_types[i] == "dense":
            im = cfg.intermediate_size
            return {m + "gate_proj.weight": rnd(im, hs), m + "up_proj.weight": rnd(im, hs),
                    m + "down_proj.weight": rnd(hs, im)}
        e, im = cfg.num_experts, cfg.moe_intermediate_size
        return {m + "gate.weight": rnd(e, hs).float(), m + "experts.gate_up_proj": rnd(e, 2 * im, hs),
                m + "experts.down_proj": rnd(e, hs, im)}

    return qwen3.init_layers(cfg, rnd, dtype, layer_mlp)


FAMILY = ModelFamily(name="qwen3_moe", config_class=Qwen3MoeConfig, attention="gqa", forward=forward,
                     init_params=init_params, kv_layouts=qwen3.kv_layouts, capturable=True,
                     draft_target=gqa_target)
