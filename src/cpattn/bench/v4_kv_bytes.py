"""Exact KV-cache bytes per request: DeepSeek-V4 vs DeepSeek-V3.2 (DSA) vs dense MLA (DeepSeek-V3).

What one request of ``L`` context tokens keeps between decode steps, in
elements (times ``bytes_per_elem``; 2 = bf16, the same for every model so
the comparison is like for like):

DeepSeek-V4, per layer (D = head_dim, W = window, m = 4 / 128, D_I = index_head_dim):

- sliding window: the last ``min(L, W - 1)`` K = V rows of D (what the
  reference keeps; the current token brings its own);
- CSA layers: ``floor(L / 4)`` entries of D and as many indexer keys of D_I,
  plus the compressors' state: ``L mod 4`` buffered tokens of ``[kv | gate]``
  (2 x 2D, and 2 x 2 D_I for the indexer) and, once a window has closed,
  the last closed window's first halves (4 x (D + D), 4 x (D_I + D_I));
- HCA layers: ``floor(L / 128)`` entries of D and ``L mod 128`` buffered
  tokens of 2D.

DeepSeek-V3.2: every layer keeps L rows of ``kv_lora_rank + qk_rope_head_dim``
(512 + 64) plus an indexer key of ``index_head_dim`` (128). Dense MLA
(DeepSeek-V3): L rows of 576 per layer.

The sizes are transformers 5.24's config defaults (:data:`V4`, :data:`V32`,
:data:`V3`): ``DeepseekV4Config()`` -- 43 layers (23 HCA, 20 CSA: 2 HCA then
HCA / CSA alternating), head_dim 512, sliding_window 128, compress_rates
4 / 128, index_head_dim 128; ``DeepseekV32Config()`` and
``DeepseekV3Config()`` -- 61 layers, kv_lora_rank 512, qk_rope_head_dim 64,
index_head_dim 128.

Example
-------
>>> row = kv_bytes_table([65536])[0]
>>> row["v4"], row["v32"], row["mla"]
(437285888, 5628755968, 4605345792)
>>> round(row["v4"] / row["v32"], 4)
0.0777
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class V4Sizes:
    """DeepSeek-V4 attention sizes (defaults: transformers' ``DeepseekV4Config()``)."""

    layer_kinds: tuple[str, ...] = ("hca",) * 3 + ("csa", "hca") * 20
    head_dim: int = 512
    window: int = 128
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_head_dim: int = 128


@dataclass(frozen=True)
class MLASizes:
    """MLA / DSA sizes (defaults: transformers' ``DeepseekV32Config()``; index_head_dim 0 = dense MLA)."""

    num_layers: int = 61
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128


V4 = V4Sizes()
V32 = MLASizes()
V3 = MLASizes(index_head_dim=0)


def v4_kv_elements(context: int, sizes: V4Sizes = V4) -> dict[str, int]:
    """Elements of V4 state for one request of ``context`` tokens, by part (see the module doc).

    >>> v4_kv_elements(130, V4Sizes(layer_kinds=("csa",)))["csa_entries"]
    16384
    """
    length, d, di = context, sizes.head_dim, sizes.index_head_dim
    n_csa = sizes.layer_kinds.count("csa")
    n_hca = sizes.layer_kinds.count("hca")
    m, mh = sizes.csa_ratio, sizes.hca_ratio
    return {
        "window": len(sizes.layer_kinds) * min(length, sizes.window - 1) * d,
        "csa_entries": n_csa * (length // m) * d,
        "csa_index_keys": n_csa * (length // m) * di,
        "hca_entries": n_hca * (length // mh) * d,
        "compressor_state": n_csa * ((length % m) * (4 * d + 4 * di) + (m * (2 * d + 2 * di) if length >= m else 0))
        + n_hca * (length % mh) * 2 * d,
    }


def mla_kv_elements(context: int, sizes: MLASizes = V32) -> int:
    """Elements of an MLA (or DSA, with indexer keys) cache for one request of ``context`` tokens.

    >>> mla_kv_elements(10, V3)
    351360
    """
    return sizes.num_layers * context * (sizes.kv_lora_rank + sizes.qk_rope_head_dim + sizes.index_head_dim)


def kv_bytes_table(contexts=(65536, 1048576), bytes_per_elem: int = 2) -> list[dict]:
    """One row per context length: bytes of V4, V3.2 and dense MLA, and per token of context."""
    rows = []
    for n in contexts:
        v4 = sum(v4_kv_elements(n).values()) * bytes_per_elem
        v32 = mla_kv_elements(n, V32) * bytes_per_elem
        mla = mla_kv_elements(n, V3) * bytes_per_elem
        rows.append({"context": n, "v4": v4, "v32": v32, "mla": mla,
                     "v4_per_token": v4 / n, "v32_per_token": v32 / n, "mla_per_token": mla / n})
    return rows
