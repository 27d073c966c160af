"""DSpark: DeepSeek's semi-autoregressive block drafter (DeepSpec), for Qwen3, DeepSeek-V3 and DeepSeek-V4 targets.

One forward drafts a whole block. The context is the target's hidden
states of the final positions, fused from a few target layers
(``ctx_p = hidden_norm(fc([h_l1 ; h_l2 ; ...]_p))``); it enters every draft
layer only as keys and values (``k_proj`` / ``v_proj`` of ``ctx``, RoPE at
p). The block is the last known token x (position S) followed by B - 1
placeholder tokens (``mask_token_id``) at positions S .. S + B - 1; it runs
through the draft layers attending non-causally over ``[context < S | the
whole block]``, and slot i predicts the token at S + i + 1::

    hn      = norm(layers([x, M, .., M]; ctx))                           # [B, H]
    d_i     = argmax(lm_head(hn_i) + markov_w2(markov_w1[d_{i-1}]))       # d_0 = x: the Markov head,
                                                                          # a low-rank bigram inside the block
    c_i     = sigmoid(confidence([hn_i ; markov_w1[d_{i-1}]]))            # estimated survival of d_i

The confidence head estimates whether d_i survives verification given
that d_1 .. d_{i-1} did; DeepSpec uses it to choose the verification
length. Under PCP the guide validates a fixed length only, so cpattn
always verifies the first k (``k <= block_size``) and reports the head's
calibration instead (:attr:`DSparkState.calibration`).

The draft cache holds context rows only (the block's rows are written past
the held length, never read again). One draft step per verification step:
its context part is the 1 + k verified rows (uniform, a
:class:`~cpattn.graphs.DecodeRunner` program with sizes multiples of
1 + k), the block B rows per request. Weight and config names follow
DeepSpec's DSpark heads (vanilla Markov head, confidence head with Markov
features).

A fused layer's row is what the target's residual stream holds after that
layer, flattened: ``[H]`` for Qwen3 / DeepSeek-V3, and for DeepSeek-V4 its
``hc_mult`` hyper-connection streams ``[n_hc, H]`` as ``n_hc * H`` features
(lossless; DeepSpec has no V4 head, this is cpattn's choice), so ``fc``
maps ``len(target_layer_ids) * target_hidden_size`` features to H
(:attr:`DSparkConfig.feature_size`).

Example
-------
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> d = DSparkDrafter.random(qwen3.init_params(cfg), cfg, block_size=4, mask_token_id=31)
>>> d.hidden_layers, d.cfg.block_size
((0, 1, 2), 4)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from cpattn.drafters import cache as kv
from cpattn.drafters import checkpoint
from cpattn.engine.drafters import DraftSettings, TargetHidden
from cpattn.graphs.runner import DecodeRunner, Field
from cpattn.models.common import mlp_dense, rms_norm, rope_cos_sin, rope_half, rope_inv_freq


@dataclass(frozen=True)
class DSparkConfig:
    """Shape of a DSpark head: draft layers (Qwen3-like, ``num_hidden_layers`` of them), the fused target
    layers and the width of one's row (``target_hidden_size``; None: ``hidden_size``, as config.json files
    written before the field read back), the block (``block_size`` slots, placeholder ``mask_token_id``),
    the Markov rank.

    >>> DSparkConfig(16, 32, 1, 2, 1, 8, 32, (0, 2), 2, 31, 4).feature_size               # 2 layers x [16]
    32
    >>> DSparkConfig(16, 32, 1, 2, 1, 8, 32, (0, 2), 2, 31, 4, target_hidden_size=64).feature_size
    128
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    markov_rank: int
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0})
    max_position_embeddings: int = 40960
    target_hidden_size: int | None = None

    def __post_init__(self):
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)

    @property
    def feature_size(self) -> int:
        """Features ``fc`` reads per position: ``len(target_layer_ids) * target_hidden_size``."""
        return len(self.target_layer_ids) * self.target_hidden_size

    @classmethod
    def for_target(cls, cfg: Any, *, block_size: int, mask_token_id: int, num_layers: int = 1,
                   markov_rank: int = 16, target_layer_ids: tuple[int, ...] | None = None) -> DSparkConfig:
        """A head for a target: its sizes (:func:`target_sizes`; heads as
        :func:`~cpattn.drafters.eagle3.attention_shape`); fused layers default to (0, n // 2 - 1, n - 2).

        >>> from cpattn.models.deepseek_v4 import DeepseekV4Config
        >>> c = DSparkConfig.for_target(DeepseekV4Config.tiny(), block_size=4, mask_token_id=63)
        >>> c.target_layer_ids, c.target_hidden_size, c.feature_size, c.intermediate_size   # 2 streams of 32
        ((0, 1), 64, 128, 16)
        """
        from cpattn.drafters.eagle3 import attention_shape

        n = cfg.num_hidden_layers
        ids = target_layer_ids or tuple(sorted({0, max(n // 2 - 1, 0), max(n - 2, 0)}))
        heads, kv_heads, head_dim = attention_shape(cfg)
        return cls(hidden_size=cfg.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
                   num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=cfg.vocab_size,
                   target_layer_ids=tuple(ids), block_size=block_size, mask_token_id=mask_token_id,
                   markov_rank=markov_rank, **target_sizes(cfg))

    def to_dict(self) -> dict:
        return {**self.__dict__, "target_layer_ids": list(self.target_layer_ids), "method": "dspark",
                "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}

    @classmethod
    def from_dict(cls, d: dict) -> DSparkConfig:
        keys = cls.__dataclass_fields__
        return cls(**{k: (tuple(v) if k == "target_layer_ids" else v) for k, v in d.items() if k in keys})


def target_sizes(cfg: Any) -> dict:
    """The :class:`DSparkConfig` fields a head takes from its target's config besides its hidden size,
    vocabulary and heads: the width of one fused layer's row, the draft MLP's size, RoPE, positions, eps.

    A DeepSeek-V4 layer's row is its ``hc_mult`` streams flattened (``n_hc * H``); V4 has no dense MLP, so
    the draft layer takes the experts' size (``moe_intermediate_size``), and the sliding layers' RoPE
    (``rope_main``: plain, without the compressed layers' YaRN). Qwen3 / DeepSeek-V3: [H] rows, their own
    ``intermediate_size`` and ``rope``.

    >>> from cpattn.models.deepseek_v4 import DeepseekV4Config
    >>> s = target_sizes(DeepseekV4Config.tiny())
    >>> s["target_hidden_size"], s["intermediate_size"], s["rope"]["rope_theta"], s["max_position_embeddings"]
    (64, 16, 10000.0, 256)
    """
    from cpattn.models.deepseek_v4 import DeepseekV4Config

    if isinstance(cfg, DeepseekV4Config):
        return {"target_hidden_size": cfg.hc_mult * cfg.hidden_size, "intermediate_size": cfg.moe_intermediate_size,
                "rope": dict(cfg.rope_main), "max_position_embeddings": cfg.max_position_embeddings,
                "rms_norm_eps": cfg.rms_norm_eps}
    return {"target_hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "rope": dict(cfg.rope), "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps}


def check_features(cfg: DSparkConfig, n: int) -> None:
    """Raise unless ``n`` features per position are what this head's fc reads (:attr:`DSparkConfig.feature_size`).

    >>> check_features(DSparkConfig(16, 32, 1, 2, 1, 8, 32, (0, 2), 2, 31, 4), 32)
    """
    if n != cfg.feature_size:
        raise ValueError(f"the target's rows of layers {cfg.target_layer_ids} have {n} features per position; this "
                         f"head's fc reads {cfg.feature_size} (target_hidden_size={cfg.target_hidden_size} per "
                         f"layer): it was made for another target (DSparkConfig.for_target)")


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


def step_fields(num_requests: int, max_len: int, feature_dim: int, dtype: torch.dtype) -> dict[str, Field]:
    """Inputs of a DSpark step: context rows (token rows: ``features`` [F] the concatenated target layers,
    F = :attr:`DSparkConfig.feature_size`; ``req`` / ``pos`` where their KV goes, pad: scratch) and per
    request the block's ``anchor`` token x, its position ``start`` S, its cache ``row`` (pad: scratch) and
    ``lo`` (first cached position).

    >>> sorted(step_fields(2, 8, 48, torch.float32))
    ['anchor', 'features', 'lo', 'pos', 'req', 'row', 'start']
    """
    return {"features": Field("token", (feature_dim,), dtype, pad=0),
            "req": Field("token", (), torch.int64, pad=num_requests),
            "pos": Field("token", (), torch.int64, pad=max_len),
            "anchor": Field("request", (), torch.int64, pad=0),
            "start": Field("request", (), torch.int64, pad=0),
            "row": Field("request", (), torch.int64, pad=num_requests),
            "lo": Field("request", (), torch.int64, pad=0)}


def dspark_step(state: dict, batch: dict, *, cfg: DSparkConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One capturable draft step: store the context rows, draft a block per request.

    state: ``{"params": ..., "cache": [L, 2, R + 1, Lmax + 1, Hkv, hd]}``.
    Returns (drafts [A, B] int64, confidence [A, B]).

    >>> from cpattn.models import qwen3
    >>> tcfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> d = DSparkDrafter.random(qwen3.init_params(tcfg), tcfg, block_size=3, mask_token_id=31)
    >>> one = torch.tensor([0])
    >>> batch = {"features": torch.randn(1, 48), "req": one, "pos": one, "anchor": torch.tensor([7]),
    ...          "start": one + 1, "row": one, "lo": one}
    >>> [t.shape for t in dspark_step(d.start(1, 8).state, batch, cfg=d.cfg)]
    [torch.Size([1, 3]), torch.Size([1, 3])]
    """
    p, cache, b = state["params"], state["cache"], cfg.block_size
    a = batch["anchor"].shape[0]
    slots = torch.arange(b, device=batch["anchor"].device)
    masks = torch.full((a, b - 1), cfg.mask_token_id, dtype=torch.int64, device=slots.device)
    tokens = torch.cat([batch["anchor"][:, None], masks], 1)  # [A, B]: x, then placeholders
    pos = (batch["start"][:, None] + slots).reshape(-1)  # [A * B]
    row = batch["row"].repeat_interleave(b)  # [A * B]
    lo = batch["lo"].repeat_interleave(b)
    hi = (batch["start"] + b).repeat_interleave(b)  # every slot sees the whole block and the context before it
    ctx = context(p, cfg, batch["features"])  # [T, H]

    def attend(i, q, k_c, v_c, k_b, v_b, scale):
        kv.write(cache[i, 0], batch["req"], batch["pos"], k_c)
        kv.write(cache[i, 1], batch["req"], batch["pos"], v_c)
        kv.write(cache[i, 0], row, pos, k_b)
        kv.write(cache[i, 1], row, pos, v_b)
        return kv.attend(q, cache[i, 0], cache[i, 1], row, lo, hi, scale)

    x = F.embedding(tokens.reshape(-1), p["embed_tokens.weight"])  # [A * B, H]
    hn = block_hidden(p, cfg, x, pos, ctx, batch["pos"], attend).view(a, b, -1)
    return draft_block(p, hn, batch["anchor"])


class DSparkState:
    """Per-rank DSpark state: context rows held per request, one block step per call (see module doc).

    calibration: one ``(confidence [k], accepted)`` pair per request and
    verification step -- the survival estimates of the k verified drafts
    and how many of them the target accepted.
    """

    def __init__(self, drafter: DSparkDrafter, num_requests: int, max_len: int, graph: str | None):
        c = drafter.cfg
        self.cfg, self.params, self.graph = c, drafter.params, graph
        self.num_requests, self.max_len = num_requests, max_len + c.block_size  # the block may run past max_len
        self.dtype = self.params["fc.weight"].dtype
        cache = torch.zeros(c.num_hidden_layers, 2, num_requests + 1, self.max_len + 1, c.num_key_value_heads,
                            c.head_dim, dtype=self.dtype)
        self.state = {"params": self.params, "cache": cache}
        self.lo, self.held, self.started = [0] * num_requests, [0] * num_requests, [False] * num_requests
        self.pending: dict[int, tuple[list[float], int]] = {}  # request -> (confidences, anchor position)
        self.calibration: list[tuple[list[float], int]] = []
        self.runners: dict[int, DecodeRunner] = {}

    def runner(self, q_len: int) -> DecodeRunner:
        """The step's runner for ``q_len`` context rows per request (captured on first use with a graph;
        another number of rows runs eagerly)."""
        if q_len not in self.runners:
            k = q_len - 1
            r = DecodeRunner(functools.partial(dspark_step, cfg=self.cfg), self.state,
                             step_fields(self.num_requests, self.max_len, self.cfg.feature_size, self.dtype),
                             num_speculative_tokens=k, capture_sizes=[self.num_requests * q_len],
                             backend=self.graph or "eager")
            self.runners[q_len] = r.capture() if self.graph is not None else r
        return self.runners[q_len]

    def propose(self, histories: list[list[int]], k: int, requests: list[int],
                hidden: TargetHidden | None = None) -> torch.Tensor:
        """The first k drafts of one block per request: [A, k] int64."""
        if k > self.cfg.block_size:
            raise ValueError(f"num_speculative_tokens={k} > the DSpark block size {self.cfg.block_size}; verify at "
                             f"most block_size drafts (or train a head with a larger block)")
        if hidden is None:
            raise ValueError("DSpark reads the target's hidden states: propose(..., hidden=TargetHidden)")
        feats = torch.cat([hidden.rows[i] for i in self.cfg.target_layer_ids], -1)  # [A, Q, F]
        check_features(self.cfg, feats.shape[-1])
        a, q = feats.shape[:2]
        req, pos = [], []
        for i, (r, h) in enumerate(zip(requests, histories)):
            start, valid = hidden.start[i], hidden.valid[i]
            if not self.started[r]:
                self.lo[r] = self.held[r] = start
                self.started[r] = True
            if start != self.held[r] or start + valid != len(h) - 1:
                raise ValueError(f"request {r}: hidden rows at positions {start}..{start + valid - 1} do not continue "
                                 f"the held context (up to {self.held[r]}) to position {len(h) - 2}")
            req += [r] * q
            pos += [start + j if j < valid else self.max_len for j in range(q)]
            self.held[r] = start + valid
        batch = {"features": feats.reshape(a * q, -1).to(self.dtype), "req": torch.tensor(req),
                 "pos": torch.tensor(pos), "anchor": torch.tensor([h[-1] for h in histories]),
                 "start": torch.tensor([len(h) - 1 for h in histories]), "row": torch.tensor(requests),
                 "lo": torch.tensor([self.lo[r] for r in requests])}
        drafts, conf = self.runner(1 + k)(batch, [q] * a)  # the prompt's rows (q != 1 + k): eager
        for i, r in enumerate(requests):
            self.pending[r] = (conf[i, :k].tolist(), len(histories[i]) - 1)
        return drafts[:, :k]

    def rollback(self, requests: list[int], keep_lens: list[int]) -> None:
        """Record each verified block's survival (for calibration); block rows lie past the held context."""
        for r, n in zip(requests, keep_lens):
            if r in self.pending:
                conf, anchor = self.pending.pop(r)
                self.calibration.append((conf, int(n) - anchor - 1))
            self.held[r] = min(self.held[r], max(int(n), self.lo[r]))


@dataclass(frozen=True)
class DSparkDrafter:
    """A DSpark head as a drafter (see module doc). params: its weights (``embed_tokens`` / ``lm_head``
    start as the target's); cfg: :class:`DSparkConfig`."""

    params: dict
    cfg: DSparkConfig
    settings: DraftSettings = DraftSettings()
    method: ClassVar[str] = "dspark"

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The fused target layers."""
        return self.cfg.target_layer_ids

    @classmethod
    def random(cls, target_params: dict, target_cfg: Any, *, block_size: int, mask_token_id: int,
               num_layers: int = 1, markov_rank: int = 16, target_layer_ids: tuple[int, ...] | None = None,
               seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.float32) -> DSparkDrafter:
        """A random head for a target (embedding and lm_head copied from the target; sizes from
        :meth:`DSparkConfig.for_target`): Qwen3, DeepSeek-V3, DeepSeek-V4 (fc reads its layers' streams).

        >>> from cpattn.models import deepseek_v4 as v4
        >>> cfg = v4.DeepseekV4Config.tiny()
        >>> d = DSparkDrafter.random(v4.init_params(cfg), cfg, block_size=4, mask_token_id=63)
        >>> d.hidden_layers, d.params["fc.weight"].shape                  # 2 layers x (2 streams x 32)
        ((0, 1), torch.Size([32, 128]))
        """
        cfg = DSparkConfig.for_target(target_cfg, block_size=block_size, mask_token_id=mask_token_id,
                                      num_layers=num_layers, markov_rank=markov_rank,
                                      target_layer_ids=target_layer_ids)
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
        return cls(p, cfg)

    @classmethod
    def from_checkpoint(cls, path, *, dtype: torch.dtype | None = None) -> DSparkDrafter:
        """A head saved by :meth:`save` (config.json with the :class:`DSparkConfig` fields)."""
        config, params = checkpoint.read(path)
        if config.get("method") != "dspark":
            raise ValueError(f"{path!r} is not a DSpark head (config.json method={config.get('method')!r})")
        if dtype is not None:
            params = {n: t.to(dtype) if t.is_floating_point() else t for n, t in params.items()}
        return cls(params, DSparkConfig.from_dict(config))

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """Write config.json and model.safetensors (floating weights cast to ``dtype`` when given)."""
        checkpoint.save(path, self.params, self.cfg.to_dict(), dtype=dtype)

    def start(self, num_requests: int, max_len: int, *, graph: str | None = None) -> DSparkState:
        """A per-rank draft state: context caches of every draft layer for ``num_requests`` x ``max_len``."""
        return DSparkState(self, num_requests, max_len, graph)
