"""DeepSeek-V4's configuration: :class:`DeepseekV4Config`, read from a Hugging Face config.json and checked.

Example
-------
>>> cfg = DeepseekV4Config.tiny()
>>> cfg.layer_types, cfg.layout().window
(('sliding', 'csa', 'hca'), 8)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cpattn.models.checks import bad, check_at_most, check_choices, check_divides, check_fields, check_rope
from cpattn.models.common import config_dict
from cpattn.v4.cache import V4Layout

HF_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
            "heavily_compressed_attention": "hca"}
_RATIO_KIND = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
# config.json fields as they must be (cpattn.models.checks.check_fields); "?": may be absent or null
CONFIG_RULES = {
    "vocab_size": "int>0", "hidden_size": "int>0", "moe_intermediate_size": "int>0", "num_hidden_layers": "int>0",
    "num_attention_heads": "int>0", "head_dim": "int>0?", "q_lora_rank": "int>0", "qk_rope_head_dim": "int>0?",
    "partial_rotary_factor": "num>0?", "n_routed_experts": "int>0", "num_experts_per_tok": "int>0",
    "routed_scaling_factor": "num>0?", "scoring_func": "str?", "compress_rate_csa": "int>0?",
    "compress_rate_hca": "int>0?", "sliding_window": "int>0?", "o_groups": "int>0?", "o_lora_rank": "int>0?",
    "index_n_heads": "int>0?", "index_head_dim": "int>0?", "index_topk": "int>0?", "hc_mult": "int>0?",
    "hc_sinkhorn_iters": "int>0?", "hc_eps": "num>0?", "swiglu_limit": "num>0?", "rms_norm_eps": "num>0?",
    "max_position_embeddings": "int>0?", "tie_word_embeddings": "bool?", "num_hash_layers": "int>=0?",
    "compress_ratios": "ints?",
}


def check_config(d: dict) -> None:
    """DeepSeek-V4's config.json fields: types, then the relations between them.

    >>> check_config({"vocab_size": 8, "hidden_size": 8, "moe_intermediate_size": 8, "num_hidden_layers": 1,
    ...               "num_attention_heads": 4, "q_lora_rank": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    ...               "o_groups": 3})
    Traceback (most recent call last):
    ...
    cpattn.models.checks.ConfigFieldError: config field 'o_groups' is 3; expected a divisor of num_attention_heads = 4 (1, 2, 4)
    """
    check_fields(d, CONFIG_RULES)
    check_at_most(d, "num_experts_per_tok", "n_routed_experts")
    check_divides(d, "o_groups", "num_attention_heads", default_small=8)
    n = d["num_hidden_layers"]
    check_choices(d, "layer_types", tuple(HF_KINDS), length=n)
    check_choices(d, "mlp_layer_types", ("hash_moe", "moe"), length=n)
    check_choices(d, "compress_ratios", tuple(_RATIO_KIND), length=n)
    if d.get("scoring_func", "sqrtsoftplus") not in ("sqrtsoftplus", "sigmoid"):
        raise bad("scoring_func", d["scoring_func"], "'sqrtsoftplus' or 'sigmoid'")


@dataclass(frozen=True)
class DeepseekV4Config:
    """The DeepSeek-V4 hyper-parameters the forward pass reads (Hugging Face names; kinds shortened)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]  # "sliding" | "csa" | "hca"
    mlp_layer_types: tuple[str, ...]  # "hash_moe" | "moe"
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    csa_ratio: int = 4
    hca_ratio: int = 128
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    rope_main: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_compress: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 160000.0})
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config: Any) -> DeepseekV4Config:
        """From a transformers ``DeepseekV4Config``, a config.json dict, or a checkpoint path.

        Older config.json spellings are folded in as transformers does:
        ``compress_ratios`` (0 / 4 / 128 per layer), ``num_hash_layers``,
        ``qk_rope_head_dim``, ``compress_rate_csa`` / ``compress_rate_hca``.
        """
        d = config_dict(config)
        if d.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"model_type is {d.get('model_type')!r}; cpattn.models.deepseek_v4 expects 'deepseek_v4'")
        check_config(d)
        n = d["num_hidden_layers"]
        rates = dict(d.get("compress_rates") or {})
        csa = rates.get("compressed_sparse_attention", d.get("compress_rate_csa", 4))
        hca = rates.get("heavily_compressed_attention", d.get("compress_rate_hca", 128))
        check_fields({"compress_rates": [csa, hca]}, {"compress_rates": "ints"})
        if min(csa, hca) <= 0:
            raise bad("compress_rates", d.get("compress_rates"), "positive compression ratios")
        types = d.get("layer_types")
        if types is None and d.get("compress_ratios") is not None:
            types = [_RATIO_KIND[r] for r in d["compress_ratios"]]
        if types is None:  # the reference default: 2 HCA layers, then HCA / CSA alternating
            alternate = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                         for i in range(max(n - 2, 0))]
            types = ["heavily_compressed_attention"] * min(n, 2) + alternate
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = d.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        head_dim = d.get("head_dim") or 512
        prf = d.get("partial_rotary_factor")
        rope_dim = int(head_dim * prf) if prf else int(d.get("qk_rope_head_dim", 64))
        main, comp = _rope_tables(d)
        for r in (main, comp):
            check_rope(r)
        if rope_dim % 2 or rope_dim > head_dim:
            raise bad("qk_rope_head_dim" if not prf else "partial_rotary_factor", prf or rope_dim,
                      f"a RoPE width that is even and at most head_dim = {head_dim} (got {rope_dim})")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], moe_intermediate_size=d["moe_intermediate_size"],
            num_hidden_layers=n, num_attention_heads=d["num_attention_heads"], head_dim=head_dim,
            q_lora_rank=d["q_lora_rank"], qk_rope_head_dim=rope_dim, n_routed_experts=d["n_routed_experts"],
            num_experts_per_tok=d["num_experts_per_tok"], layer_types=tuple(HF_KINDS[t] for t in types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]), routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            scoring_func=d.get("scoring_func", "sqrtsoftplus"), csa_ratio=csa, hca_ratio=hca,
            sliding_window=d.get("sliding_window", 128), o_groups=d.get("o_groups", 8),
            o_lora_rank=d.get("o_lora_rank", 1024), index_n_heads=d.get("index_n_heads", 64),
            index_head_dim=d.get("index_head_dim", 128), index_topk=d.get("index_topk", 512),
            hc_mult=d.get("hc_mult", 4), hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20),
            hc_eps=d.get("hc_eps", 1e-6), swiglu_limit=d.get("swiglu_limit", 10.0),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_main=main, rope_compress=comp,
            max_position_embeddings=d.get("max_position_embeddings", 1048576),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )

    def to_hf(self) -> dict:
        """The config.json dict (transformers' field names and kinds) that :meth:`from_hf` reads back equal.

        >>> cfg = DeepseekV4Config.tiny()
        >>> DeepseekV4Config.from_hf(cfg.to_hf()) == cfg, cfg.to_hf()["layer_types"][1]
        (True, 'compressed_sparse_attention')
        """
        kinds = {short: name for name, short in HF_KINDS.items()}
        d = {k: v for k, v in asdict(self).items() if k not in ("rope_main", "rope_compress", "csa_ratio", "hca_ratio")}
        return {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], **d,
                "layer_types": [kinds[t] for t in self.layer_types], "mlp_layer_types": list(self.mlp_layer_types),
                "compress_rates": {"compressed_sparse_attention": self.csa_ratio,
                                   "heavily_compressed_attention": self.hca_ratio},
                "rope_parameters": {"main": dict(self.rope_main), "compress": dict(self.rope_compress)},
                "num_nextn_predict_layers": 0}

    @classmethod
    def tiny(cls, **over) -> DeepseekV4Config:
        """A tiny test/demo configuration: 3 layers (sliding, CSA, HCA), window 8, ratios 4 / 16."""
        base = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
                    num_attention_heads=4, head_dim=16, q_lora_rank=24, qk_rope_head_dim=8, n_routed_experts=4,
                    num_experts_per_tok=2, layer_types=("sliding", "csa", "hca"),
                    mlp_layer_types=("hash_moe", "moe", "moe"), hca_ratio=16, sliding_window=8, o_groups=2,
                    o_lora_rank=8, index_n_heads=2, index_head_dim=12, index_topk=3, hc_mult=2,
                    max_position_embeddings=256)
        base.update(over)
        return cls(**base)

    def layout(self, *, max_rewind: int = 0, block_size: int = 16) -> V4Layout:
        """The :class:`~cpattn.v4.cache.V4Layout` of this model's attention state."""
        return V4Layout(kinds=self.layer_types, head_dim=self.head_dim, window=self.sliding_window,
                        csa_ratio=self.csa_ratio, hca_ratio=self.hca_ratio, index_head_dim=self.index_head_dim,
                        max_rewind=max_rewind, block_size=block_size)


def _rope_tables(d: dict) -> tuple[dict, dict]:
    """The "main" and "compress" RoPE settings (YaRN, if any, only on compress; its cos/sin scale forced to 1)."""
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = dict(rp["main"]), dict(rp["compress"])
    else:
        scaling = {k: v for k, v in {**(d.get("rope_scaling") or {}), **rp}.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
        comp = {**scaling, "rope_theta": d.get("compress_rope_theta", 160000.0)}
    for r in (main, comp):
        r["rope_type"] = r.get("rope_type", r.get("type", "default")) or "default"
        if r["rope_type"] == "yarn":
            r.setdefault("attention_factor", 1.0)
            r.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return main, comp
