"""Exact KV bytes (cpattn.v4.kv_bytes): the sizes are transformers' defaults, and the element counts
are what Hugging Face's own DeepSeek-V4 cache holds after a prefill."""

from __future__ import annotations

import pytest
import torch

from cpattn.v4.kv_bytes import V3, V4, V32, V4Sizes, kv_bytes_table, mla_kv_elements, v4_kv_elements

transformers = pytest.importorskip("transformers")

KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def test_sizes_are_the_transformers_defaults():
    c = transformers.DeepseekV4Config()
    assert V4.layer_kinds == tuple(KINDS[t] for t in c.layer_types)
    assert (V4.head_dim, V4.window, V4.index_head_dim) == (c.head_dim, c.sliding_window, c.index_head_dim)
    assert (V4.csa_ratio, V4.hca_ratio) == (c.compress_rates["compressed_sparse_attention"],
                                            c.compress_rates["heavily_compressed_attention"])
    for sizes, cls in ((V32, transformers.DeepseekV32Config), (V3, transformers.DeepseekV3Config)):
        c = cls()
        assert (sizes.num_layers, sizes.kv_lora_rank, sizes.qk_rope_head_dim) == (
            c.num_hidden_layers, c.kv_lora_rank, c.qk_rope_head_dim)
        assert sizes.index_head_dim == getattr(c, "index_head_dim", 0)


@pytest.mark.parametrize("length", [3, 37, 48])
def test_counts_match_the_reference_cache(length):
    """Prefill the tiny HF model and count what its cache keeps (K = V rows once)."""
    from test_v4_model_hf import hf_model

    model = hf_model()
    with torch.no_grad():
        cache = model(torch.arange(length)[None] % 64, use_cache=True).past_key_values
    held = 0
    for layer in cache.layers:
        held += layer.keys.numel()  # the window (values alias or duplicate the keys: K = V)
        for states in ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
            held += sum(t.numel() for t in getattr(layer, states, {}).values() if t is not None)
    c = model.config
    sizes = V4Sizes(layer_kinds=tuple(KINDS[t] for t in c.layer_types), head_dim=c.head_dim, window=c.sliding_window,
                    csa_ratio=4, hca_ratio=16, index_head_dim=c.index_head_dim)
    assert sum(v4_kv_elements(length, sizes).values()) == held


def test_table():
    short, long = kv_bytes_table([65536, 1048576])
    assert short["v32"] == mla_kv_elements(65536, V32) * 2 == 61 * 704 * 65536 * 2
    assert short["mla_per_token"] == 61 * 576 * 2
    assert long["v4"] < long["v32"] / 13  # V4 keeps under 1/13 of V3.2's bytes at 1M tokens
