"""Eagle3: EAGLE-3's draft head as a drafter (Qwen3 / Qwen3-MoE targets).

From the EAGLE-3 paper: the target's hidden states from a low, a middle
and a high layer are concatenated and projected by ``fc`` to one feature
``g_p`` [H]; one decoder layer combines it with the next token's
embedding and predicts over a reduced draft vocabulary, mapped back to
target ids by ``d2t`` (target id = draft id + ``d2t[draft id]``)::

    g_p  = fc([h_low ; h_mid ; h_high]_p)                       # [3H] -> [H]
    z    = [input_layernorm(emb(t_{p+1})) ; hidden_norm(g_p)]   # [2H]: q, k, v from both
    y    = g_p + o_proj(attn(z))  ;  y = y + mlp(post_attention_layernorm(y))
    t_{p+2} = d2t-map(argmax(lm_head(norm(y))))                 # draft vocab -> target ids

RoPE at position p (hidden state p pairs with token p + 1). Drafting k
tokens continues autoregressively on the layer's own output ``y`` as the
next feature (:mod:`cpattn.drafters.chain`). Per-head q/k RMSNorm as the
Qwen3 target has. Weight names follow DeepSeek's DeepSpec Eagle3 heads
(``fc``, ``layers.0.*``, ``norm``, ``lm_head``) plus ``d2t``.

Example
-------
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> d = Eagle3Drafter.random(qwen3.init_params(cfg), cfg, draft_vocab=24)
>>> d.hidden_layers, d.params["d2t"].shape
((0, 1, 2), torch.Size([24]))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from cpattn.drafters import cache as kv
from cpattn.drafters import checkpoint
from cpattn.drafters.chain import ChainState
from cpattn.engine.drafters import DraftSettings
from cpattn.models.draft_target import target_of
from cpattn.models.common import mlp_dense, rms_norm, rope_cos_sin, rope_half, rope_inv_freq


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an Eagle3 head: its decoder layer's sizes (the target's by default), the target layers it
    fuses (residual stream after each), the vocabularies (target ``vocab_size``, reduced ``draft_vocab_size``)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0})
    max_position_embeddings: int = 40960

    @classmethod
    def for_target(cls, cfg: Any, *, draft_vocab: int | None = None,
                   target_layer_ids: tuple[int, ...] | None = None) -> Eagle3Config:
        """The head for a target config: its hidden and MLP sizes and draft heads as its family declares them
        (:func:`~cpattn.models.draft_target.target_of`; a target without GQA fields, e.g. MLA, gets
        ``hidden / heads``-dim heads, two queries per KV head), and low/mid/high layers spread over its depth
        (default ``(0, n // 2 - 1, n - 2)``: never the last layer, whose state the target's own head reads).
        A target whose hidden rows are wider than ``H`` (DeepSeek-V4's streams) is refused: use DSpark."""
        t = target_of(cfg)
        if t.row_width != t.hidden_size:
            raise ValueError(f"{type(cfg).__name__}: a layer's hidden row is {t.row_width} wide, not hidden_size "
                             f"{t.hidden_size}; Eagle3 fuses [H] rows: draft this target with DSpark "
                             "(DSparkConfig.for_target reads the row width)")
        n = cfg.num_hidden_layers
        ids = target_layer_ids or tuple(sorted({0, max(n // 2 - 1, 0), max(n - 2, 0)}))
        heads, kv_heads, head_dim = t.attention_shape
        return cls(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                   head_dim=head_dim, vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab or cfg.vocab_size,
                   target_layer_ids=tuple(ids), rms_norm_eps=t.rms_norm_eps, rope=dict(t.rope),
                   max_position_embeddings=t.max_position_embeddings)

    def to_dict(self) -> dict:
        return {**self.__dict__, "target_layer_ids": list(self.target_layer_ids), "method": "eagle3"}

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        keys = cls.__dataclass_fields__
        return cls(**{k: (tuple(v) if k == "target_layer_ids" else v) for k, v in d.items() if k in keys})


def attention_shape(cfg: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a draft layer for target ``cfg``, as its family declares them
    (:attr:`cpattn.models.draft_target.DraftTarget.attention_shape`): the target's own GQA shape, or for a
    target without one (MLA) ``hidden / heads``-dim heads, two queries per KV head.

    >>> from cpattn.models import deepseek_v3
    >>> attention_shape(deepseek_v3.DeepseekV3Config.tiny())
    (4, 2, 16)
    """
    return target_of(cfg).attention_shape


def fuse(params: dict, cfg: Eagle3Config, rows: dict) -> torch.Tensor:
    """``fc([h_low ; h_mid ; h_high])``: target hidden rows ``{layer: [..., H]}`` -> features [..., H].

    >>> cfg = Eagle3Config(16, 32, 2, 1, 8, 32, 32, (0, 2))
    >>> fuse({"fc.weight": torch.ones(16, 32)}, cfg, {0: torch.ones(3, 16), 2: torch.zeros(3, 16)})[0, :2].tolist()
    [16.0, 16.0]
    """
    h = torch.cat([rows[i] for i in cfg.target_layer_ids], -1)
    return F.linear(h.to(params["fc.weight"].dtype), params["fc.weight"])


def eagle3_layer(params: dict, cfg: Eagle3Config, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
                 attend) -> tuple[torch.Tensor, torch.Tensor]:
    """The head on rows (t_{p+1}, g_p): (draft-vocab logits [T, Vd], output feature y [T, H]).

    ``attend(q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd], scale) -> [T, Hq, hd]``
    stores the rows' KV and attends (the draft cache, or a causal mask in training).

    >>> from cpattn.models import qwen3
    >>> tcfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> d = Eagle3Drafter.random(qwen3.init_params(tcfg), tcfg, draft_vocab=24)
    >>> logits, y = eagle3_layer(d.params, d.cfg, torch.tensor([1, 2]), torch.randn(2, 16), torch.arange(2),
    ...                          lambda q, k, v, scale: q)                 # a stand-in attention
    >>> logits.shape, y.shape
    (torch.Size([2, 24]), torch.Size([2, 16]))
    """
    p, eps, pre = params, cfg.rms_norm_eps, "layers.0."
    t, hq, hkv, hd = tokens.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e = F.embedding(tokens, p["embed_tokens.weight"])  # [T, H]
    z = torch.cat([rms_norm(e, p[pre + "input_layernorm.weight"], eps),
                   rms_norm(g, p[pre + "hidden_norm.weight"], eps)], -1)  # [T, 2H]
    a = pre + "self_attn."
    q = F.linear(z, p[a + "q_proj.weight"]).view(t, hq, hd)
    k = F.linear(z, p[a + "k_proj.weight"]).view(t, hkv, hd)
    v = F.linear(z, p[a + "v_proj.weight"]).view(t, hkv, hd)
    inv_freq, att = rope_inv_freq(hd, cfg.rope, cfg.max_position_embeddings)
    cos, sin = rope_cos_sin(positions, inv_freq, att, g.dtype)  # [T, hd / 2]
    q = rope_half(rms_norm(q, p[a + "q_norm.weight"], eps), cos, sin)
    k = rope_half(rms_norm(k, p[a + "k_norm.weight"], eps), cos, sin)
    o = attend(q, k, v, hd**-0.5)  # [T, Hq, hd]
    y = g + F.linear(o.reshape(t, hq * hd), p[a + "o_proj.weight"])
    y = y + mlp_dense(p, pre + "mlp.", rms_norm(y, p[pre + "post_attention_layernorm.weight"], eps))
    return F.linear(rms_norm(y, p["norm.weight"], eps), p["lm_head.weight"]), y


def to_target(params: dict, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary ids -> target ids: ``id + d2t[id]``.

    >>> to_target({"d2t": torch.tensor([0, 2, 5])}, torch.tensor([2, 1])).tolist()
    [7, 3]
    """
    return draft_ids + params["d2t"][draft_ids]


def eagle3_step(state: dict, batch: dict, *, cfg: Eagle3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """One capturable draft step over rows (:func:`cpattn.drafters.chain.step_fields`).

    state: ``{"params": ..., "cache": [2, R + 1, L + 1, Hkv, hd]}`` (keys, values).
    Returns (greedy target tokens [T], output features [T, H]).

    >>> from cpattn.models import qwen3
    >>> tcfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> d = Eagle3Drafter.random(qwen3.init_params(tcfg), tcfg)
    >>> one = torch.tensor([0])
    >>> batch = {"tokens": torch.tensor([5]), "features": torch.randn(1, 16), "req": one, "pos": one, "lo": one,
    ...          "hi": one + 1}
    >>> [t.shape for t in eagle3_step(d.start(1, 8).state, batch, cfg=d.cfg)]
    [torch.Size([1]), torch.Size([1, 16])]
    """
    attend = kv.step_attention(state["cache"], batch)
    logits, y = eagle3_layer(state["params"], cfg, batch["tokens"], batch["features"], batch["pos"], attend)
    return to_target(state["params"], logits.argmax(-1)), y


@dataclass(frozen=True)
class Eagle3Drafter:
    """An EAGLE-3 head as a drafter (see module doc). params: its weights (``embed_tokens.weight`` is the
    target's embedding, ``d2t`` [Vd] int64); cfg: :class:`Eagle3Config`."""

    params: dict
    cfg: Eagle3Config
    settings: DraftSettings = DraftSettings()
    method: ClassVar[str] = "eagle3"

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The fused target layers (low, mid, high)."""
        return self.cfg.target_layer_ids

    @classmethod
    def random(cls, target_params: dict, target_cfg: Any, *, draft_vocab: int | None = None,
               target_layer_ids: tuple[int, ...] | None = None, seed: int = 0, std: float = 0.02,
               dtype: torch.dtype = torch.float32, vocab: list[int] | None = None) -> Eagle3Drafter:
        """A random head for a Qwen3-like target; the draft vocabulary is ``vocab`` (target ids, e.g. the most
        frequent ones) or the first ``draft_vocab`` ids; ``lm_head`` starts from the target's rows of it."""
        cfg = Eagle3Config.for_target(target_cfg, draft_vocab=len(vocab) if vocab else draft_vocab,
                                      target_layer_ids=target_layer_ids)
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape):
            return (torch.randn(*shape, generator=g) * std).to(dtype)

        hs, im, hq, hkv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, \
            cfg.num_key_value_heads, cfg.head_dim
        ids = torch.tensor(sorted(vocab) if vocab else range(cfg.draft_vocab_size), dtype=torch.int64)
        head = target_params.get("lm_head.weight", target_params["model.embed_tokens.weight"])
        one = torch.ones(hs, dtype=dtype)
        a = "layers.0.self_attn."
        p = {"embed_tokens.weight": target_params["model.embed_tokens.weight"].to(dtype).clone(),
             "fc.weight": rnd(hs, len(cfg.target_layer_ids) * hs),
             "layers.0.input_layernorm.weight": one.clone(), "layers.0.hidden_norm.weight": one.clone(),
             "layers.0.post_attention_layernorm.weight": one.clone(),
             a + "q_proj.weight": rnd(hq * hd, 2 * hs), a + "k_proj.weight": rnd(hkv * hd, 2 * hs),
             a + "v_proj.weight": rnd(hkv * hd, 2 * hs), a + "o_proj.weight": rnd(hs, hq * hd),
             a + "q_norm.weight": torch.ones(hd, dtype=dtype), a + "k_norm.weight": torch.ones(hd, dtype=dtype),
             "layers.0.mlp.gate_proj.weight": rnd(im, hs), "layers.0.mlp.up_proj.weight": rnd(im, hs),
             "layers.0.mlp.down_proj.weight": rnd(hs, im), "norm.weight": one.clone(),
             "lm_head.weight": head[ids].to(dtype).clone(), "d2t": ids - torch.arange(len(ids))}
        return cls(p, cfg)

    @classmethod
    def from_checkpoint(cls, path, *, dtype: torch.dtype | None = None) -> Eagle3Drafter:
        """A head saved by :meth:`save` (config.json with the :class:`Eagle3Config` fields)."""
        config, params = checkpoint.read(path)
        if config.get("method") != "eagle3":
            raise ValueError(f"{path!r} is not an Eagle3 head (config.json method={config.get('method')!r})")
        if dtype is not None:
            params = {n: t.to(dtype) if t.is_floating_point() else t for n, t in params.items()}
        return cls(params, Eagle3Config.from_dict(config))

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """Write config.json and model.safetensors (floating weights cast to ``dtype`` when given)."""
        checkpoint.save(path, self.params, self.cfg.to_dict(), dtype=dtype)

    def start(self, num_requests: int, max_len: int, *, graph: str | None = None) -> ChainState:
        """A per-rank draft state: the layer's KV cache for ``num_requests`` x ``max_len`` positions."""
        dtype = self.params["fc.weight"].dtype
        c = self.cfg
        state = {"params": self.params, "cache": kv.new_cache(2, requests=num_requests, max_len=max_len,
                                                              heads=c.num_key_value_heads, dim=c.head_dim,
                                                              dtype=dtype)}
        step = functools.partial(eagle3_step, cfg=c)
        return ChainState(step, functools.partial(fuse, self.params, c), state, num_requests=num_requests,
                          max_len=max_len, feature_dim=c.hidden_size, dtype=dtype, graph=graph)
