"""The DSpark head's math: the fused context, the draft layers over a block, the Markov and confidence heads.

Pure functions of the weights (names as DeepSpec's DSpark heads); the
draft cache is the caller's (``attend``), so training and inference share them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.drafters.dspark.config import DSparkConfig, check_features
from cpattn.models.common import mlp_dense, rms_norm, rope_cos_sin, rope_half, rope_inv_freq


def context(params: dict, cfg: DSparkConfig, rows: dict | torch.Tensor) -> torch.Tensor:
    """``hidden_norm(fc([h_l1 ; h_l2 ; ..]))``: target rows ``{layer: [..., target_hidden_size]}`` (or their
    concatenation [..., feature_size]) -> [..., H].

    >>> cfg = DSparkConfig(16, 32, 1, 2, 1, 8, 32, (0,), 2, 31, 4)
    >>> p = {"fc.weight": torch.eye(16), "hidden_norm.weight": torch.ones(16)}
    >>> context(p, cfg, {0: torch.full((1, 16), 3.0)}).round(decimals=4).tolist()[0][:2]   # RMS-normed
    [1.0, 1.0]
    """
    h = rows if isinstance(rows, torch.Tensor) else torch.cat([rows[i] for i in cfg.target_layer_ids], -1)
    check_features(cfg, h.shape[-1])
    return rms_norm(F.linear(h.to(params["fc.weight"].dtype), params["fc.weight"]), params["hidden_norm.weight"],
                    cfg.rms_norm_eps)


def block_hidden(params: dict, cfg: DSparkConfig, x: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor,
                 ctx_pos: torch.Tensor, attend) -> torch.Tensor:
    """The draft layers on block rows x [N, H] (positions pos [N]) with context rows ctx [M, H] (ctx_pos [M]).

    ``attend(layer, q [N, Hq, hd], k_ctx, v_ctx [M, Hkv, hd], k_blk, v_blk [N, Hkv, hd], scale) -> [N, Hq, hd]``
    places the rows' keys and applies the block mask (the draft cache at inference, an explicit mask in
    training). Returns the final-normed block states hn [N, H].

    >>> from cpattn.drafters.dspark import DSparkDrafter
    >>> from cpattn.models import qwen3
    >>> tcfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> d = DSparkDrafter.random(qwen3.init_params(tcfg), tcfg, block_size=2, mask_token_id=31)
    >>> attend = lambda i, q, k_c, v_c, k_b, v_b, scale: q               # a stand-in attention
    >>> block_hidden(d.params, d.cfg, torch.randn(2, 16), torch.arange(2), torch.randn(3, 16), torch.arange(3),
    ...              attend).shape
    torch.Size([2, 16])
    """
    p, eps = params, cfg.rms_norm_eps
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv_freq, att = rope_inv_freq(hd, cfg.rope, cfg.max_position_embeddings)
    cos, sin = rope_cos_sin(pos, inv_freq, att, x.dtype)  # [N, hd / 2]
    cos_c, sin_c = rope_cos_sin(ctx_pos, inv_freq, att, x.dtype)  # [M, hd / 2]
    n, m = x.shape[0], ctx.shape[0]
    for i in range(cfg.num_hidden_layers):
        a = f"layers.{i}.self_attn."
        z = rms_norm(x, p[f"layers.{i}.input_layernorm.weight"], eps)
        q = rope_half(rms_norm(F.linear(z, p[a + "q_proj.weight"]).view(n, hq, hd), p[a + "q_norm.weight"], eps),
                      cos, sin)
        k_b = rope_half(rms_norm(F.linear(z, p[a + "k_proj.weight"]).view(n, hkv, hd), p[a + "k_norm.weight"], eps),
                        cos, sin)
        v_b = F.linear(z, p[a + "v_proj.weight"]).view(n, hkv, hd)
        k_c = rope_half(rms_norm(F.linear(ctx, p[a + "k_proj.weight"]).view(m, hkv, hd), p[a + "k_norm.weight"],
                                 eps), cos_c, sin_c)
        v_c = F.linear(ctx, p[a + "v_proj.weight"]).view(m, hkv, hd)
        o = attend(i, q, k_c, v_c, k_b, v_b, hd**-0.5)  # [N, Hq, hd]
        x = x + F.linear(o.reshape(n, hq * hd), p[a + "o_proj.weight"])
        x = x + mlp_dense(p, f"layers.{i}.mlp.", rms_norm(x, p[f"layers.{i}.post_attention_layernorm.weight"], eps))
    return rms_norm(x, p["norm.weight"], eps)


def heads(params: dict, hn: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Markov-corrected logits and confidence logits of block slots hn [..., H] given the previous tokens prev [...].

    Returns (logits [..., V], confidence logits [...]); ``sigmoid`` of the latter is the survival estimate.

    >>> p = {"markov_head.markov_w1.weight": torch.ones(8, 2), "markov_head.markov_w2.weight": torch.zeros(8, 2),
    ...      "lm_head.weight": torch.eye(8, 4), "confidence_head.proj.weight": torch.zeros(1, 6),
    ...      "confidence_head.proj.bias": torch.zeros(1)}
    >>> logits, conf = heads(p, torch.tensor([[0.0, 1.0, 0.0, 0.0]]), torch.tensor([3]))
    >>> logits.argmax(-1).tolist(), torch.sigmoid(conf).tolist()
    ([1], [0.5])
    """
    e = F.embedding(prev, params["markov_head.markov_w1.weight"])  # [..., r]
    logits = F.linear(hn, params["lm_head.weight"]) + F.linear(e, params["markov_head.markov_w2.weight"])
    conf = F.linear(torch.cat([hn, e.to(hn.dtype)], -1), params["confidence_head.proj.weight"],
                    params["confidence_head.proj.bias"])[..., 0]
    return logits, conf


def draft_block(params: dict, hn: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy drafts through the Markov head, slot by slot: hn [A, B, H], first [A] (the token x) ->
    (drafts [A, B] int64, confidence [A, B] in [0, 1]).

    >>> p = {"markov_head.markov_w1.weight": torch.eye(4), "markov_head.markov_w2.weight": 5 * torch.eye(4).roll(1, 0),
    ...      "lm_head.weight": torch.zeros(4, 2), "confidence_head.proj.weight": torch.zeros(1, 6),
    ...      "confidence_head.proj.bias": torch.zeros(1)}
    >>> draft_block(p, torch.zeros(1, 3, 2), torch.tensor([0]))[0].tolist()    # a pure bigram: 0 -> 1 -> 2 -> 3
    [[1, 2, 3]]
    """
    prev, drafts, conf = first, [], []
    for i in range(hn.shape[1]):
        logits, c = heads(params, hn[:, i], prev)
        prev = logits.argmax(-1)
        drafts.append(prev)
        conf.append(torch.sigmoid(c.float()))
    return torch.stack(drafts, 1), torch.stack(conf, 1)

