"""Tiny targets that are worth drafting for: trained on :mod:`~cpattn.lab.corpus`, saved as checkpoints.

A random-weight target says nothing about acceptance (its continuations
have no structure a drafter could learn). This module trains a tiny
Qwen3 (for Eagle3 / DSpark) or DeepSeek-V3 (MLA + MoE, for MTP) on the
synthetic corpus for a few minutes on CPU, with the families' own forward
functions (:mod:`cpattn.models`) over whole sequences
(:class:`SequenceAttention`), and saves it as a Hugging Face checkpoint
directory (config.json + model.safetensors, plus the corpus that made it)
that :func:`cpattn.models.load_checkpoint` and transformers read.
:func:`greedy_data` then produces what self-distillation trains on: the
target's own greedy continuations of corpus prompts, its hidden states and
its argmax at every position.

A family whose cache is not per-token KV rows (DeepSeek-V4, ``ModelFamily.cache
= "v4"``: its attention state is rings and compressed entries)
does not run through :class:`SequenceAttention`, so it is not trained here;
:func:`save` writes one (e.g. random-init) as a checkpoint that
``cpattn train-draft`` reads, and :func:`greedy_data` takes it through the
engine instead (one-device greedy generation, then its own prefill over the
whole sequences).

Example
-------
>>> cfg = tiny_config("qwen3", vocab_size=32, hidden_size=16, num_layers=2)
>>> params = init("qwen3", cfg, seed=0)
>>> attn = SequenceAttention(get_family("qwen3").kv_layouts(cfg), batch=2, length=5)
>>> get_family("qwen3").forward(params, cfg, torch.ones(10, dtype=torch.int64), attn).shape
torch.Size([10, 32])
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from cpattn.drafters import checkpoint
from cpattn.lab.corpus import Corpus
from cpattn.models.family import KVLayout, get_family
from cpattn.models import deepseek_v3, qwen3


def tiny_config(model: str, *, vocab_size: int = 64, hidden_size: int = 64, num_layers: int = 4) -> Any:
    """A tiny target config: Qwen3 (GQA 4/2 heads of hidden/4) or DeepSeek-V3 (MLA, MoE above layer 0).

    >>> tiny_config("deepseek_v3").mlp_layer_types
    ('dense', 'sparse', 'sparse', 'sparse')
    """
    if model == "qwen3":
        return qwen3.Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                 num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=hidden_size // 4)
    if model == "deepseek_v3":
        return deepseek_v3.DeepseekV3Config.tiny(vocab_size=vocab_size, hidden_size=hidden_size,
                                                 num_hidden_layers=num_layers,
                                                 mlp_layer_types=("dense",) + ("sparse",) * (num_layers - 1))
    raise ValueError(f"tiny targets are 'qwen3' or 'deepseek_v3'; got {model!r}")


def init(model: str, cfg: Any, *, seed: int) -> dict:
    """Random float32 weights (std 0.02) for a tiny target.

    >>> init("qwen3", tiny_config("qwen3", hidden_size=16, num_layers=1), seed=0)["lm_head.weight"].shape
    torch.Size([64, 16])
    """
    return get_family(model).init_params(cfg, seed=seed, std=0.02, dtype=torch.float32)


def hf_config(model: str, cfg: Any) -> dict:
    """Deprecated: ``cfg.to_hf()`` (each family config writes its own config.json dict; ``model`` is unused).

    >>> import warnings
    >>> cfg = tiny_config("deepseek_v3")
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     hf_config("deepseek_v3", cfg) == cfg.to_hf()
    True
    """
    warnings.warn("cpattn.lab.target.hf_config(model, cfg) is deprecated; use cfg.to_hf()", DeprecationWarning,
                  stacklevel=2)
    return cfg.to_hf()


def warmup_cosine(step: int, total: int, warmup: int = 20) -> float:
    """Learning-rate factor: linear warm-up (``warmup`` steps, at most a tenth of ``total``), then cosine
    down to 10%.

    >>> [round(warmup_cosine(s, 400), 2) for s in (0, 20, 400)]
    [0.05, 1.0, 0.1]
    """
    warmup = max(1, min(warmup, total // 10))
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


class SequenceAttention:
    """The attention step of ``batch`` whole sequences of ``length`` tokens, packed [batch * length]: causal
    within each sequence (``F.scaled_dot_product_attention``); differentiable, no cache. Values may be the
    first ``v_head_dim`` dims of the keys (MLA's latent row)."""

    def __init__(self, layouts: tuple[KVLayout, ...], *, batch: int, length: int, device="cpu"):
        self.layouts, self.b, self.t = layouts, batch, length
        self.positions = torch.arange(length, device=device).repeat(batch)  # [B * T]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
        if v is None:
            v = k[..., : self.layouts[layer].v_head_dim]
        b, t = self.b, self.t

        def bhtd(x):
            return x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(bhtd(q), bhtd(k), bhtd(v), is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])  # [B, Hq, T, Dv]
        return out.transpose(1, 2).reshape(b * t, q.shape[1], v.shape[-1])


class BatchCache:
    """A KV cache of ``batch`` equally long sequences for greedy continuation: one step appends the same
    number of tokens to each (``step(n)``), attention over the prefix through SDPA.

    >>> cache = BatchCache((KVLayout(1, 4, 4),), batch=2, max_len=5, dtype=torch.float32)
    >>> x = torch.ones(6, 1, 4)
    >>> cache.step(3)(0, x, x, x, 0.5).shape, cache.len
    (torch.Size([6, 1, 4]), 3)
    """

    def __init__(self, layouts: tuple[KVLayout, ...], *, batch: int, max_len: int, dtype: torch.dtype):
        self.layouts, self.b, self.len = layouts, batch, 0
        self.k = [torch.zeros(batch, max_len, lay.num_kv_heads, lay.head_dim, dtype=dtype) for lay in layouts]
        self.v = [None if lay.values_in_keys else torch.zeros(batch, max_len, lay.num_kv_heads, lay.v_head_dim,
                                                              dtype=dtype) for lay in layouts]
        self.n = 0

    def step(self, n: int) -> BatchCache:
        """Plan a step of n new tokens per sequence (packed [batch * n], sequence-major)."""
        self.n = n
        self.positions = torch.arange(self.len, self.len + n).repeat(self.b)
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
        b, n, s = self.b, self.n, self.len
        lay = self.layouts[layer]
        self.k[layer][:, s : s + n] = k.view(b, n, *k.shape[1:])
        if v is not None:
            self.v[layer][:, s : s + n] = v.view(b, n, *v.shape[1:])
        kk = self.k[layer][:, : s + n]
        vv = kk[..., : lay.v_head_dim] if v is None else self.v[layer][:, : s + n]
        mask = torch.ones(n, s + n, dtype=torch.bool).tril(s)  # bottom-right aligned causal
        out = F.scaled_dot_product_attention(q.view(b, n, *q.shape[1:]).transpose(1, 2), kk.transpose(1, 2),
                                             vv.transpose(1, 2), attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        if layer == len(self.layouts) - 1:
            self.len += n
        return out.transpose(1, 2).reshape(b * n, q.shape[1], vv.shape[-1])


def forward(model: str, params: dict, cfg: Any, tokens: torch.Tensor, *, hidden_layers=None):
    """The target on whole sequences tokens [B, T]: logits [B, T, V] (and hidden ``{name: [B, T, H]}``).

    >>> cfg = tiny_config("qwen3", hidden_size=16, num_layers=2)
    >>> logits, hidden = forward("qwen3", init("qwen3", cfg, seed=0), cfg, torch.ones(2, 3, dtype=torch.int64),
    ...                          hidden_layers=(1,))
    >>> logits.shape, sorted(hidden, key=str)
    (torch.Size([2, 3, 64]), [1, 'norm'])
    """
    fam = get_family(model)
    if not fam.backend.per_token_kv:
        raise ValueError(f"{model} keeps its own cache (ModelFamily.cache={fam.cache!r}), not per-token KV rows that "
                         "a whole-sequence SequenceAttention holds: it cannot be trained here; greedy_data takes it "
                         "through the engine")
    b, t = tokens.shape
    attn = SequenceAttention(fam.kv_layouts(cfg), batch=b, length=t, device=tokens.device)
    out = fam.forward(params, cfg, tokens.reshape(-1), attn, hidden_layers=hidden_layers)
    if hidden_layers is None:
        return out.view(b, t, -1)
    logits, hidden = out
    return logits.view(b, t, -1), {n: h.view(b, t, -1) for n, h in hidden.items()}


def train(model: str, cfg: Any, corpus: Corpus, *, seconds: float, seed: int, batch: int = 32, length: int = 64,
          lr: float = 3e-3, max_steps: int | None = None, on_step=None) -> tuple[dict, list[float]]:
    """Train a tiny target on the corpus for ``seconds``, or exactly ``max_steps`` steps (reproducible on a
    loaded machine): Adam, next-token loss. Returns (params, loss per step). ``on_step(step, loss)`` after
    each step. At least one step runs.

    >>> cfg = tiny_config("qwen3", vocab_size=16, hidden_size=16, num_layers=1)
    >>> _, losses = train("qwen3", cfg, Corpus.make(16, seed=0), seconds=0, seed=0, batch=2, length=8, max_steps=3)
    >>> len(losses)
    3
    """
    torch.manual_seed(seed)
    params = {n: t.clone().requires_grad_(t.is_floating_point()) for n, t in init(model, cfg, seed=seed).items()}
    train_params = [t for n, t in params.items() if t.requires_grad and "e_score_correction_bias" not in n]
    opt = torch.optim.Adam(train_params, lr=lr)
    losses, step, t0, expected = [], 0, time.perf_counter(), max_steps
    while (step < max_steps) if max_steps is not None else (step == 0 or time.perf_counter() - t0 < seconds):
        x = corpus.sample(batch, length + 1, seed=seed * 1_000_003 + step)
        logits = forward(model, params, cfg, x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        if expected is None and step == 2:  # pace the schedule by the measured step time
            expected = max(10, int(seconds / max((time.perf_counter() - t0) / 3, 1e-6)))
        for group in opt.param_groups:
            group["lr"] = lr * warmup_cosine(step, expected or 10_000)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(train_params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if on_step is not None:
            on_step(step, losses[-1])
    return {n: t.detach() for n, t in params.items()}, losses


def save(path: str | os.PathLike, model: str, cfg: Any, params: dict, corpus: Corpus | None = None,
         dtype: torch.dtype | None = None) -> None:
    """Write the target as a checkpoint directory: config.json is ``cfg.to_hf()`` (``torch_dtype``: the weights'
    dtype as written), weights under per-expert names as transformers saves them, floating ones cast to
    ``dtype`` when given. ``model`` (the family name) is not read: the config knows its family.

    >>> import tempfile
    >>> d, cfg = tempfile.mkdtemp(), tiny_config("qwen3", hidden_size=16, num_layers=1)
    >>> save(d, "qwen3", cfg, init("qwen3", cfg, seed=0), dtype=torch.bfloat16)
    >>> load(d)[1] == cfg
    True
    """
    written = dtype or params["model.embed_tokens.weight"].dtype
    config = {**cfg.to_hf(), "torch_dtype": str(written).removeprefix("torch.")}
    checkpoint.save(path, checkpoint.unstack_experts(params), config, dtype=dtype)
    if corpus is not None:
        corpus.save(path)


def load(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> tuple[str, Any, dict]:
    """(family name, family config, params) of a checkpoint directory (see :func:`save`).

    A DeepSeek-V3 checkpoint's router weights stay float32 whatever ``dtype`` is; the engine keeps its caches
    in the dtype most weights have (:func:`~cpattn.models.family.param_dtype`).
    """
    from cpattn.models import load_checkpoint

    config, params = load_checkpoint(path, dtype=dtype)
    fam = get_family(config)
    return fam.name, fam.config_class.from_hf(config), params


@dataclasses.dataclass(frozen=True)
class GreedyData:
    """Self-distillation data: tokens [N, T] (prompt + the target's greedy continuation), hidden
    ``{name: [N, T, H]}`` (the target's, at every position), greedy [N, T] (its argmax at each position:
    the token it would emit next), prompt_len."""

    tokens: torch.Tensor
    hidden: dict
    greedy: torch.Tensor
    prompt_len: int


@torch.no_grad()
def greedy_data(model: str, params: dict, cfg: Any, prompts: torch.Tensor, length: int,
                hidden_layers: tuple, *, deadline: float | None = None, chunk: int = 32,
                on_chunk=None) -> GreedyData:
    """Continue prompts [N, P] greedily to ``length`` tokens (a batch KV cache), then one forward over the
    whole sequences for the hidden states and argmax of every position. A family whose cache is not
    per-token KV rows (DeepSeek-V4) goes through the engine instead (:func:`engine_greedy_data`).

    The prompts go ``chunk`` at a time; with a ``deadline`` (a ``time.perf_counter()`` value) no new
    chunk starts past it, so the data may hold fewer than N sequences (at least one chunk).
    ``on_chunk(done, total)`` is called after each chunk.

    >>> cfg = tiny_config("qwen3", hidden_size=16, num_layers=2)
    >>> d = greedy_data("qwen3", init("qwen3", cfg, seed=0), cfg, torch.ones(2, 3, dtype=torch.int64), 6, (0,))
    >>> d.tokens.shape, torch.equal(d.greedy[:, 2:-1], d.tokens[:, 3:])
    (torch.Size([2, 6]), True)
    >>> greedy_data("qwen3", init("qwen3", cfg, seed=0), cfg, torch.ones(4, 3, dtype=torch.int64), 6, (0,),
    ...             deadline=0.0, chunk=2).tokens.shape   # past the deadline: the first chunk only
    torch.Size([2, 6])
    """
    parts = []
    for a in range(0, prompts.shape[0], chunk):
        if parts and deadline is not None and time.perf_counter() >= deadline:
            break
        parts.append(_greedy_chunk(model, params, cfg, prompts[a : a + chunk], length, hidden_layers))
        if on_chunk is not None:
            on_chunk(min(a + chunk, prompts.shape[0]), prompts.shape[0])
    if len(parts) == 1:
        return parts[0]
    return GreedyData(torch.cat([d.tokens for d in parts]), {n: torch.cat([d.hidden[n] for d in parts])
                                                             for n in parts[0].hidden},
                      torch.cat([d.greedy for d in parts]), parts[0].prompt_len)


def _greedy_chunk(model: str, params: dict, cfg: Any, prompts: torch.Tensor, length: int,
                  hidden_layers: tuple) -> GreedyData:
    fam = get_family(model)
    if not fam.backend.per_token_kv:
        return engine_greedy_data(model, params, cfg, prompts, length, hidden_layers)
    dtype = params["model.embed_tokens.weight"].dtype
    cache = BatchCache(fam.kv_layouts(cfg), batch=prompts.shape[0], max_len=length, dtype=dtype)
    x, new = prompts, prompts
    while x.shape[1] < length:
        logits = fam.forward(params, cfg, new.reshape(-1), cache.step(new.shape[1]))
        new = logits.view(x.shape[0], new.shape[1], -1)[:, -1:].argmax(-1)  # [N, 1]
        x = torch.cat([x, new], 1)
    logits, hidden = forward(model, params, cfg, x, hidden_layers=tuple(hidden_layers))
    return GreedyData(x, hidden, logits.argmax(-1), prompts.shape[1])


@torch.no_grad()
def engine_greedy_data(model: str, params: dict, cfg: Any, prompts: torch.Tensor, length: int,
                       hidden_layers: tuple) -> GreedyData:
    """:func:`greedy_data` through the engine, for any family (DeepSeek-V4's own cache included): the
    continuation from one-device greedy generation (:func:`cpattn.engine.classic.generate`), then the
    family's one-device prefill over the whole sequences [N, length] with ``hidden_layers``, its hidden
    states ``{name: [N, length, F]}`` (trailing dims flattened: a DeepSeek-V4 layer's n_hc streams are
    ``n_hc * H`` features) and every position's argmax.

    >>> from cpattn.models import deepseek_v4
    >>> cfg = deepseek_v4.DeepseekV4Config.tiny()
    >>> p = deepseek_v4.init_params(cfg, seed=0)
    >>> d = engine_greedy_data("deepseek_v4", p, cfg, torch.ones(2, 3, dtype=torch.int64), 6, (0,))
    >>> d.tokens.shape, d.hidden[0].shape, d.hidden["norm"].shape    # layer 0: 2 streams of 32
    (torch.Size([2, 6]), torch.Size([2, 6, 64]), torch.Size([2, 6, 32]))
    >>> torch.equal(d.greedy[:, 2:-1], d.tokens[:, 3:])
    True
    """
    from cpattn.comm.sim import SimMesh
    from cpattn.engine.batch import Prompts
    from cpattn.engine.driver import prefill_fn
    from cpattn.engine.options import Algorithms
    from cpattn.engine.classic import generate

    n, p = prompts.shape
    x = prompts
    if length > p:
        x = torch.cat([prompts, generate(model, params, cfg, prompts.tolist(), length - p).tokens], 1)  # [N, length]
    out = prefill_fn(SimMesh(1).groups()[0], get_family(model), params, cfg,
                     Prompts.of(x.tolist(), vocab_size=cfg.vocab_size), Algorithms(), prompt_logits=True,
                     hidden_layers=tuple(hidden_layers))
    hidden = {name: h.reshape(n, x.shape[1], -1) for name, h in out.hidden.items()}
    return GreedyData(x, hidden, out.prompt_logits.view(n, x.shape[1], -1).argmax(-1), p)
