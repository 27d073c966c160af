"""Random initialisation of a DSpark head (embedding and lm_head copied from its target)."""

from __future__ import annotations

import torch

from cpattn.drafters.dspark.config import DSparkConfig


def random_params(target_params: dict, cfg: DSparkConfig, *, seed: int = 0, std: float = 0.02,
                  dtype: torch.dtype = torch.float32) -> dict:
    """A head's weights for ``cfg``: ``embed_tokens`` / ``lm_head`` copied from the target's params (cast to
    ``dtype``), projections ~ N(0, ``std``) from ``seed``, norms 1, ``markov_w2`` and biases 0.

    >>> cfg = DSparkConfig(16, 32, 1, 2, 1, 8, 32, (0, 2), 2, 31, 4)
    >>> p = random_params({"model.embed_tokens.weight": torch.zeros(32, 16)}, cfg)
    >>> p["fc.weight"].shape, p["lm_head.weight"].shape, len(p)
    (torch.Size([16, 32]), torch.Size([32, 16]), 20)
    """
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    hs, im, hq, hkv, hd, v, r = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, \
        cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, cfg.markov_rank
    head = target_params.get("lm_head.weight", target_params["model.embed_tokens.weight"])
    p = {"embed_tokens.weight": target_params["model.embed_tokens.weight"].to(dtype).clone(),
         "lm_head.weight": head.to(dtype).clone(), "fc.weight": rnd(hs, cfg.feature_size),
         "hidden_norm.weight": torch.ones(hs, dtype=dtype), "norm.weight": torch.ones(hs, dtype=dtype),
         "markov_head.markov_w1.weight": rnd(v, r), "markov_head.markov_w2.weight": torch.zeros(v, r, dtype=dtype),
         "confidence_head.proj.weight": rnd(1, hs + r), "confidence_head.proj.bias": torch.zeros(1, dtype=dtype)}
    for i in range(cfg.num_hidden_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        p.update({f"layers.{i}.input_layernorm.weight": torch.ones(hs, dtype=dtype),
                  f"layers.{i}.post_attention_layernorm.weight": torch.ones(hs, dtype=dtype),
                  a + "q_proj.weight": rnd(hq * hd, hs), a + "k_proj.weight": rnd(hkv * hd, hs),
                  a + "v_proj.weight": rnd(hkv * hd, hs), a + "o_proj.weight": rnd(hs, hq * hd),
                  a + "q_norm.weight": torch.ones(hd, dtype=dtype),
                  a + "k_norm.weight": torch.ones(hd, dtype=dtype),
                  m + "gate_proj.weight": rnd(im, hs), m + "up_proj.weight": rnd(im, hs),
                  m + "down_proj.weight": rnd(hs, im)})
    return p
