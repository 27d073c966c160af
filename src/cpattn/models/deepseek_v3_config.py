"""DeepSeek-V3's configuration: the config.json rules (:data:`CONFIG_RULES`, :func:`check_config`, shared
by V2, V3.2 and GLM-5) and :class:`DeepseekV3Config` (``from_hf`` / ``to_hf`` / ``tiny``, the softmax scale).

The forward pass is :mod:`cpattn.models.deepseek_v3`, which re-exports these names.

>>> DeepseekV3Config.tiny().qk_head_dim
24
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from cpattn.models.checks import bad, check_at_most, check_choices, check_divides, check_fields, check_rope
from cpattn.models.common import config_dict, rope_parameters, yarn_mscale
from cpattn.models.moe import MOE_IMPLS

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
