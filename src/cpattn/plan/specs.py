"""Model shapes for the performance model: built-in entries, or any Hugging Face ``config.json``.

A :class:`ModelSpec` holds what costs depend on: the attention kind and its
dims (GQA heads; MLA latent 512 + rope 64; DSA indexer heads / dim / top-k),
the MLP (dense width, or routed experts, top-k, shared experts and the
leading dense layers), the vocabulary, and the bytes per weight and per KV
element. Parameter counts, FLOPs and bytes are derived from these
(:mod:`cpattn.plan.costs`).

Built-ins (each release's ``config.json`` fields; pass ``--model
path/config.json`` to use the file itself): DeepSeek-V3.2 and DeepSeek-R1
(the V3 architecture), GLM-5, Qwen3-235B-A22B, Kimi-K2 and
DeepSeek-V4-Flash are read through their families' own ``from_hf``
(:mod:`cpattn.plan.families`, as is any ``config.json`` of a family's
``model_type``); Llama3-405B (dense, for an anchor; no cpattn family) is
the one literal here, and :func:`from_hf_config` reads the model types no
family reads.

Example
-------
>>> m = get_model("deepseek-v3.2")
>>> m.attention, m.kv_bytes_per_token_layer()  # latent 512 + rope 64 (bf16) + fp8 indexer key 128 + scale
('dsa', 1284)
>>> round(get_model("qwen3-235b-a22b").total_params() / 1e9)
235
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "w8a8": 1.0, "int4": 0.5 + 1 / 64,
                "nvfp4": 0.5 + 1 / 16, "fp32": 4.0}


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of one model (see module doc). ``weights`` / ``kv_dtype``: keys of :data:`WEIGHT_BYTES`."""

    name: str
    attention: str  # "gqa", "mla", "dsa" or "v4" (DeepSeek-V4: sliding / CSA / HCA layers)
    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int = 1
    head_dim: int = 128
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    intermediate: int = 0
    moe_intermediate: int = 0
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    weights: str = "bf16"
    kv_dtype: str = "bf16"
    source: str = ""
    # DeepSeek-V4 ("v4"): each layer's kind ("sliding", "csa", "hca"), the sliding window, the compression
    # ratios, the grouped output projection and the hyper-connection width (cpattn.plan.families)
    layer_kinds: tuple[str, ...] = ()
    window: int = 0
    csa_ratio: int = 4
    hca_ratio: int = 128
    o_groups: int = 0
    o_lora_rank: int = 0
    hc_mult: int = 1

    # -- parameters ------------------------------------------------------------------
    def attn_params(self, layer: int | None = None) -> int:
        """Attention weights of one layer (indexer included for DSA; for V4 the ``layer``'s kind: compressors,
        and the indexer of a CSA layer; ``None``: the mean over the layers)."""
        h, d = self.heads, self.hidden
        if self.attention == "v4":
            if layer is None:
                return round(sum(self.attn_params(i) for i in range(self.layers)) / self.layers)
            return self._v4_attn_params(self.layer_kinds[layer])
        if self.attention == "gqa":
            return d * h * self.head_dim * 2 + 2 * d * self.kv_heads * self.head_dim
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = d * h * qk if self.q_lora_rank is None else d * self.q_lora_rank + self.q_lora_rank * h * qk
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        out = h * self.v_head_dim * d
        idx = 0
        if self.attention == "dsa":
            idx = (self.q_lora_rank or d) * self.index_heads * self.index_dim + d * self.index_dim + d * self.index_heads
        return q + kv + out + idx

    def _v4_attn_params(self, kind: str) -> int:
        """One V4 layer (cpattn.models.deepseek_v4's shapes): q LoRA, the K = V projection, the grouped
        output LoRA, the compressors (CSA: two series of 2 x head_dim and of the indexer's; HCA: one), the
        CSA indexer's query and weights, and the two hyper-connection mixers."""
        d, hd, q, n = self.hidden, self.head_dim, self.q_lora_rank or self.hidden, self.hc_mult
        base = (d * q + q * self.heads * hd + d * hd + self.o_lora_rank * self.heads * hd
                + d * self.o_groups * self.o_lora_rank)
        comp = {"sliding": 0, "hca": 2 * hd * d,
                "csa": 2 * 2 * hd * d + 2 * 2 * self.index_dim * d + q * self.index_heads * self.index_dim
                + self.index_heads * d}[kind]
        return base + comp + 2 * (2 + n) * n * n * d

    def mlp_params(self, layer: int) -> tuple[int, int]:
        """(weights read by every token, routed-expert weights of the layer) of one layer's MLP."""
        if self.experts == 0 or layer < self.dense_layers:
            return 3 * self.hidden * self.intermediate, 0
        one = 3 * self.hidden * self.moe_intermediate
        return self.shared_experts * one + self.hidden * self.experts, self.experts * one

    def total_params(self) -> int:
        """Every weight (embedding and lm_head included)."""
        mlp = sum(sum(self.mlp_params(i)) for i in range(self.layers))
        return sum(self.attn_params(i) for i in range(self.layers)) + mlp + 2 * self.vocab * self.hidden

    def active_params_per_token(self) -> int:
        """Weights one token multiplies through (top-k routed experts only), lm_head excluded."""
        one = 3 * self.hidden * self.moe_intermediate
        mlp = sum(self.mlp_params(i)[0] + (self.experts_per_token * one if self.mlp_params(i)[1] else 0)
                  for i in range(self.layers))
        return sum(self.attn_params(i) for i in range(self.layers)) + mlp

    # -- KV cache ----------------------------------------------------------------------
    def kv_bytes_per_token_layer(self, kv_heads: int | None = None, layer: int | None = None) -> float:
        """KV bytes of one token in one layer: GQA ``2 * kv_heads * head_dim``; MLA the latent
        ``kv_lora_rank + qk_rope_head_dim``; DSA adds the FP8 indexer key (``index_dim`` + a 4-byte scale).
        V4: one compressed entry of ``head_dim`` per ``ratio`` tokens (CSA adds its FP8 indexer key; a
        sliding layer holds only its window, no bytes per token); ``layer=None``: the mean over the layers."""
        b = WEIGHT_BYTES[self.kv_dtype]
        if self.attention == "v4":
            if layer is None:
                return sum(self.kv_bytes_per_token_layer(layer=i) for i in range(self.layers)) / self.layers
            kind = self.layer_kinds[layer]
            if kind == "sliding":
                return 0.0
            ratio = self.csa_ratio if kind == "csa" else self.hca_ratio
            return (self.head_dim * b + (self.index_dim + 4 if kind == "csa" else 0)) / ratio
        if self.attention == "gqa":
            return int(2 * (self.kv_heads if kv_heads is None else kv_heads) * self.head_dim * b)
        kv = int((self.kv_lora_rank + self.qk_rope_head_dim) * b)
        return kv + (self.index_dim + 4 if self.attention == "dsa" else 0)

    def weight_bytes(self) -> float:
        return WEIGHT_BYTES[self.weights]

    def replace(self, **changes) -> ModelSpec:
        return dataclasses.replace(self, **changes)


BUILTINS = {  # entries without a cpattn family; every other built-in is read by its family (plan.families)
    "llama3-405b": ModelSpec(name="Llama3-405B", attention="gqa", layers=126, hidden=16384, vocab=128256, heads=128,
                             kv_heads=8, head_dim=128, intermediate=53248, weights="bf16",
                             source="meta-llama/Llama-3.1-405B config.json"),
}


def from_hf_config(config: dict[str, Any], *, name: str | None = None, weights: str | None = None,
                   kv_dtype: str = "bf16") -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` dict of a ``model_type`` no cpattn family reads
    (Llama-style GQA, and MLA / DSA configs of other names); :func:`get_model` reads every family's type
    (:data:`cpattn.plan.families.FAMILY_TYPES`) through the family's own ``from_hf`` instead.

    >>> cfg = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 100,
    ...        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}
    >>> from_hf_config(cfg).kv_bytes_per_token_layer()
    128
    """
    c = config.get("text_config", config)
    kind = c.get("model_type", "")
    quant = (c.get("quantization_config") or {}).get("quant_method") or (c.get("quantization_config") or {}).get("quant_algo")
    if weights is None:
        weights = {"fp8": "fp8", "NVFP4": "nvfp4", "compressed-tensors": "int4"}.get(str(quant), "bf16")
    mla = "kv_lora_rank" in c and c.get("kv_lora_rank")
    attention = "dsa" if c.get("index_topk") else "mla" if mla else "gqa"
    common = dict(name=name or c.get("_name_or_path") or kind or "model", layers=int(c["num_hidden_layers"]),
                  hidden=int(c["hidden_size"]), vocab=int(c["vocab_size"]), heads=int(c["num_attention_heads"]),
                  weights=weights, kv_dtype=kv_dtype, source="config.json")
    moe = dict(moe_intermediate=int(c.get("moe_intermediate_size") or 0),
               experts=int(c.get("n_routed_experts") or c.get("num_experts") or 0),
               experts_per_token=int(c.get("num_experts_per_tok") or 0),
               shared_experts=int(c.get("n_shared_experts") or 0),
               dense_layers=int(c.get("first_k_dense_replace") or 0),
               intermediate=int(c.get("intermediate_size") or 0))
    if attention == "gqa":
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return ModelSpec(attention="gqa", kv_heads=int(c.get("num_key_value_heads") or c["num_attention_heads"]),
                         head_dim=int(hd), **common, **moe)
    return ModelSpec(attention=attention, q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=int(c["kv_lora_rank"]),
                     qk_nope_head_dim=int(c["qk_nope_head_dim"]), qk_rope_head_dim=int(c["qk_rope_head_dim"]),
                     v_head_dim=int(c["v_head_dim"]), index_heads=int(c.get("index_n_heads") or 0),
                     index_dim=int(c.get("index_head_dim") or 0), index_topk=int(c.get("index_topk") or 0),
                     **common, **moe)


def get_model(name_or_path: str, **overrides) -> ModelSpec:
    """A built-in entry (case-insensitive), or a ``config.json`` path / a directory holding one."""
    from cpattn.plan.families import FAMILY_BUILTINS, FAMILY_TYPES, spec_from_family

    key = name_or_path.lower()
    if key in BUILTINS:
        spec = BUILTINS[key]
    elif key in FAMILY_BUILTINS:
        spec = spec_from_family(key)
    else:
        path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
        if not os.path.isfile(path):
            names = ", ".join([*FAMILY_BUILTINS, *BUILTINS])
            raise ValueError(f"unknown model {name_or_path!r}; choose one of {names} or pass a Hugging Face "
                             "config.json (or its directory)")
        with open(path) as f:
            config = json.load(f)
        label = os.path.basename(os.path.dirname(os.path.abspath(path)))
        if isinstance(config, dict) and config.get("model_type") in FAMILY_TYPES:
            spec = spec_from_family(config, name=label)
        else:
            spec = from_hf_config(config, name=label)
    return spec.replace(**{k: v for k, v in overrides.items() if v is not None})
