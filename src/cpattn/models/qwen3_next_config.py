"""The Qwen3-Next / Qwen3.5 text configuration: the fields the forward reads, checked, and
:meth:`Qwen3NextConfig.from_hf` for config.json (the composite ``qwen3_5`` form too).

>>> Qwen3NextConfig.tiny().layer_types  # a pattern other than every 4th
('linear_attention', 'full_attention', 'linear_attention', 'linear_attention')
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cpattn.models.checks import bad, check_at_most, check_choices, check_divides, check_fields, check_rope
from cpattn.models.common import config_dict, rope_parameters
from cpattn.models.moe import MOE_IMPLS

LAYER_TYPES = ("linear_attention", "full_attention")
# qwen3_5 / qwen3_5_moe: the Hub's composite forms (text_config nested)
MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
COMPOSITE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # composite -> its text model_type
CONFIG_RULES = {"vocab_size": "int>0", "hidden_size": "int>0", "intermediate_size": "int>0",
                "num_hidden_layers": "int>0", "num_attention_heads": "int>0", "num_key_value_heads": "int>0?",
                "head_dim": "int>0?", "rms_norm_eps": "num>0?", "max_position_embeddings": "int>0?",
                "tie_word_embeddings": "bool?", "attention_bias": "bool?", "layer_types": "strs?",
                "full_attention_interval": "int>0?", "linear_conv_kernel_dim": "int>0?",
                "linear_key_head_dim": "int>0?", "linear_value_head_dim": "int>0?", "linear_num_key_heads": "int>0?",
                "linear_num_value_heads": "int>0?", "decoder_sparse_step": "int>0?", "moe_intermediate_size": "int>0?",
                "shared_expert_intermediate_size": "int>=0?", "num_experts_per_tok": "int>=0?",
                "num_experts": "int>=0?", "norm_topk_prob": "bool?", "mlp_only_layers": "ints?", "hidden_act": "str?"}


@dataclass(frozen=True)
class Qwen3NextConfig:
    """The hyper-parameters the forward reads (names as in config.json; ``mlp_layer_types`` derived).

    split_projections: the linear layers' input projections as Qwen3.5 stores them (``in_proj_qkv`` in
    conv order, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); False: Qwen3-Next's ``in_proj_qkvz`` /
    ``in_proj_ba``, grouped per key head.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25})
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_layer_types: tuple[str, ...] = ()
    moe_impl: str = "auto"
    split_projections: bool = False

    def __post_init__(self):
        n = self.num_hidden_layers
        if len(self.layer_types) != n or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types {self.layer_types} must give one of {LAYER_TYPES} per layer ({n})")
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", ("dense",) * n)
        if len(self.mlp_layer_types) != n or any(t not in ("dense", "sparse") for t in self.mlp_layer_types):
            raise ValueError(f"mlp_layer_types {self.mlp_layer_types} must give 'dense' or 'sparse' per layer ({n})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads = {self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads = {self.linear_num_key_heads}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}; got {self.moe_impl!r}")

    @property
    def rotary_dim(self) -> int:
        """RoPE'd dims of each attention head: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * float(self.rope.get("partial_rotary_factor", 1.0)))

    @property
    def conv_channels(self) -> int:
        """Channels of the linear layers' conv: ``q | k | v`` = ``2 Hk Dk + Hv Dv``."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def layer_slots(self, kind: str) -> list[int]:
        """Indices of the layers of ``kind`` ("full_attention" / "linear_attention"); slot j is the j-th."""
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @classmethod
    def tiny(cls, **over) -> Qwen3NextConfig:
        """A tiny test/demo configuration: 4 layers (linear, full, linear, linear), 4 / 1 attention heads (so
        DCP 2 and 4 divide them), linear heads 1 key / 3 value, MoE (6 experts, top-2, a shared expert) except
        layer 2, vocab 64."""
        base = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=16,
                    layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"),
                    linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=1,
                    linear_num_value_heads=3, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=24, mlp_layer_types=("sparse", "sparse", "dense", "sparse"))
        base.update(over)
        return cls(**base)

    @classmethod
    def from_hf(cls, config: Any) -> Qwen3NextConfig:
        """From a transformers ``Qwen3NextConfig``, a config.json dict, or a checkpoint path.

        >>> d = dict(model_type="qwen3_next", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=3,
        ...          num_attention_heads=2, num_key_value_heads=1, head_dim=4, full_attention_interval=3,
        ...          num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
        >>> c = Qwen3NextConfig.from_hf(d)
        >>> c.layer_types, c.mlp_layer_types
        (('linear_attention', 'linear_attention', 'full_attention'), ('sparse', 'dense', 'sparse'))
        """
        d = config_dict(config)
        kind = d.get("model_type", "qwen3_next")
        if kind in COMPOSITE:  # the Hub's composite form: the text model's config is nested
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise bad("text_config", text, f"the text model's config (a {kind} checkpoint nests it)")
            d = {"tie_word_embeddings": d.get("tie_word_embeddings", False), **text, "model_type": COMPOSITE[kind]}
            kind = COMPOSITE[kind]
        if kind not in MODEL_TYPES:
            raise ValueError(f"model_type is {kind!r}; this family expects one of {MODEL_TYPES}")
        if kind == "qwen3_5_moe_text":  # every layer is MoE (renormalised top-k): no dense MLP size in the config
            d = {**d, "intermediate_size": d.get("intermediate_size") or d.get("moe_intermediate_size") or 512,
                 "norm_topk_prob": True}
        check_fields(d, CONFIG_RULES)
        check_divides(d, "num_key_value_heads", "num_attention_heads")
        check_divides(d, "linear_num_key_heads", "linear_num_value_heads")
        if d.get("hidden_act", "silu") != "silu":
            raise bad("hidden_act", d.get("hidden_act"), "'silu' (the activation Qwen3-Next's blocks use)")
        n = d["num_hidden_layers"]
        check_choices(d, "layer_types", LAYER_TYPES, length=n)
        types = d.get("layer_types")
        if types is None:
            every = d.get("full_attention_interval") or 4
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        rope = rope_parameters(d)
        rope.setdefault("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
        check_rope(rope)
        experts, step = d.get("num_experts") or 0, d.get("decoder_sparse_step") or 1
        only = set(d.get("mlp_only_layers") or ())
        if experts:
            check_at_most(d, "num_experts_per_tok", "num_experts")
            if not d.get("num_experts_per_tok"):
                raise bad("num_experts_per_tok", d.get("num_experts_per_tok"), f"1..{experts} (experts per token)")
        mlp = tuple("sparse" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(n))
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=n, num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"], layer_types=tuple(types),
            linear_conv_kernel_dim=d.get("linear_conv_kernel_dim") or 4,
            linear_key_head_dim=d.get("linear_key_head_dim") or 128,
            linear_value_head_dim=d.get("linear_value_head_dim") or 128,
            linear_num_key_heads=d.get("linear_num_key_heads") or 16,
            linear_num_value_heads=d.get("linear_num_value_heads") or 32, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope=rope, max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)), num_experts=experts,
            num_experts_per_tok=d.get("num_experts_per_tok") or 0,
            moe_intermediate_size=d.get("moe_intermediate_size") or 512,
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
            norm_topk_prob=bool(d.get("norm_topk_prob", True)), mlp_layer_types=mlp,
            split_projections=kind in ("qwen3_5_text", "qwen3_5_moe_text"))

    def to_hf(self) -> dict:
        """The config.json dict that :meth:`from_hf` reads back equal: ``qwen3_next`` (``qwen3_5_text`` with
        split projections); dense layers as ``mlp_only_layers``; ``moe_impl`` (a runtime switch) not written.

        >>> cfg = Qwen3NextConfig.tiny()
        >>> Qwen3NextConfig.from_hf(cfg.to_hf()) == cfg, cfg.to_hf()["mlp_only_layers"]
        (True, [2])
        """
        skip = ("rope", "mlp_layer_types", "moe_impl", "split_projections")
        d = {k: v for k, v in asdict(self).items() if k not in skip}
        kind, arch = ("qwen3_5_text", "Qwen3_5ForCausalLM") if self.split_projections else ("qwen3_next",
                                                                                              "Qwen3NextForCausalLM")
        return {"model_type": kind, "architectures": [arch], **d,
                "layer_types": list(self.layer_types), "rope_parameters": dict(self.rope), "hidden_act": "silu",
                "decoder_sparse_step": 1, "mlp_only_layers": [i for i, t in enumerate(self.mlp_layer_types)
                                                              if t == "dense"]}


@dataclass(frozen=True)
class Qwen3_5Config(Qwen3NextConfig):
    """Qwen3.5 text (``qwen3_5`` / ``qwen3_5_text``): :class:`Qwen3NextConfig` whose tiny model has Qwen3.5's
    layout (split input projections, dense MLPs).

    >>> c = Qwen3_5Config.tiny()
    >>> c.split_projections, c.mlp_layer_types
    (True, ('dense', 'dense', 'dense', 'dense'))
    """

    @classmethod
    def tiny(cls, **over) -> Qwen3_5Config:
        """:meth:`Qwen3NextConfig.tiny` with split projections and dense MLPs (no experts)."""
        base = dict(split_projections=True, num_experts=0, num_experts_per_tok=0, shared_expert_intermediate_size=0,
                    mlp_layer_types=("dense",) * 4)
        return super().tiny(**{**base, **over})

    def to_hf(self) -> dict:
        """The Hub's composite config.json (``qwen3_5``, the text model's config nested) that :meth:`from_hf`
        reads back equal.

        >>> cfg = Qwen3_5Config.tiny()
        >>> Qwen3_5Config.from_hf(cfg.to_hf()) == cfg, cfg.to_hf()["text_config"]["model_type"]
        (True, 'qwen3_5_text')
        """
        text = {**{k: v for k, v in super().to_hf().items() if k != "architectures"}, "model_type": "qwen3_5_text"}
        return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
                "tie_word_embeddings": self.tie_word_embeddings}


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3NextConfig):
    """Qwen3.5-MoE text (``qwen3_5_moe`` / ``qwen3_5_moe_text``): split input projections, every layer MoE
    (softmax top-k renormalised, a gated shared expert).

    >>> c = Qwen3_5MoeConfig.tiny()
    >>> c.split_projections, c.mlp_layer_types
    (True, ('sparse', 'sparse', 'sparse', 'sparse'))
    """

    @classmethod
    def tiny(cls, **over) -> Qwen3_5MoeConfig:
        """:meth:`Qwen3NextConfig.tiny` with split projections and MoE in every layer."""
        return super().tiny(**{"split_projections": True, "mlp_layer_types": ("sparse",) * 4, **over})

    def to_hf(self) -> dict:
        """The Hub's composite config.json (``qwen3_5_moe``, the text model's config nested) that
        :meth:`from_hf` reads back equal.

        >>> cfg = Qwen3_5MoeConfig.tiny()
        >>> Qwen3_5MoeConfig.from_hf(cfg.to_hf()) == cfg, cfg.to_hf()["text_config"]["model_type"]
        (True, 'qwen3_5_moe_text')
        """
        text = {**{k: v for k, v in Qwen3NextConfig.to_hf(self).items() if k != "architectures"},
                "model_type": "qwen3_5_moe_text"}
        return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "text_config": text, "tie_word_embeddings": self.tie_word_embeddings}
