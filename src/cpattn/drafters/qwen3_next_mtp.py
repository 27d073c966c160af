"""Qwen3-Next's MTP module as a drafter (Qwen3-Next / Qwen3.5 / Qwen3.5-MoE targets: hybrid models).

Qwen3-Next checkpoints carry one multi-token-prediction layer under ``mtp.*``
(transformers 5.24 ignores it: ``_keys_to_ignore_on_load_unexpected =
[r"^mtp.*"]``; the structure below is the published one, as vLLM's
``qwen3_next_mtp`` reads it). From the target's final-normed hidden state
``h_p`` and the next token ``t_{p+1}`` it predicts ``t_{p+2}``, embedding
first::

    x  = fc([pre_fc_norm_embedding(emb(t_{p+1})) ; pre_fc_norm_hidden(h_p)])   # [2H] -> [H], no bias
    y  = x + attn(input_layernorm(x))         # a full-attention layer of the target's kind (gated GQA,
    y  = y + mlp(post_attention_layernorm(y)) #   q/k norm, partial RoPE at p), MoE when the target has experts
    hn = norm(y)                              # mtp.norm
    t_{p+2} = argmax(lm_head(hn))             # the target's lm_head (and embedding): shared

Every norm is Qwen3-Next's ``x_hat * (1 + weight)``. Drafting k > 1 tokens
chains the one layer on its own ``hn`` as the next depth's ``h``
(:mod:`cpattn.drafters.chain`), its KV in the drafter's own dense cache
(replicated on every rank, logical PCP 1, as every cpattn drafter).

Weights: the checkpoint's names (``mtp.fc.weight``, ``mtp.layers.0.self_attn.q_proj.weight`` ...,
experts stacked), plus the target's ``model.embed_tokens.weight`` and
``lm_head.weight`` (tied models: the embedding).

Example
-------
>>> from cpattn.models import qwen3_next as qn
>>> cfg = qn.Qwen3NextConfig.tiny()
>>> d = Qwen3NextMTPDrafter.random(cfg, qn.init_params(cfg), seed=0)
>>> d.method, d.hidden_layers, d.params["mtp.fc.weight"].shape
('mtp', (), torch.Size([48, 96]))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from cpattn.drafters import cache as kv
from cpattn.drafters import checkpoint
from cpattn.drafters.chain import ChainState
from cpattn.engine.drafters import DraftSettings
from cpattn.models import qwen3_next as qn
from cpattn.models.common import lm_head
from cpattn.models.draft_target import target_of

TARGETS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # hybrid families whose checkpoints carry ``mtp.*``
SHARED = ("model.embed_tokens.weight", "lm_head.weight")  # the target's tensors the module reads
OWN = ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


def block_config(cfg: qn.Qwen3NextConfig) -> qn.Qwen3NextConfig:
    """The target config extended by the MTP layer as layer N, as its family declares it (full attention; MoE
    when the target has experts).

    >>> block_config(qn.Qwen3NextConfig.tiny()).layer_types[-1], block_config(qn.Qwen3NextConfig.tiny()).mlp_layer_types
    ('full_attention', ('sparse', 'sparse', 'dense', 'sparse', 'sparse'))
    """
    return target_of(cfg).extend(cfg)


def as_layer(params: dict, n: int) -> dict:
    """The module's tensors renamed for the target's blocks: ``mtp.layers.0.*`` -> ``model.layers.{n}.*`` (the
    rest as they are), so :func:`cpattn.models.qwen3_next.attention_block` / ``mlp_block`` run it as layer n.

    >>> sorted(as_layer({"mtp.layers.0.input_layernorm.weight": 1, "mtp.fc.weight": 2}, 4))
    ['model.layers.4.input_layernorm.weight', 'mtp.fc.weight']
    """
    pre = "mtp.layers.0."
    return {(f"model.layers.{n}." + k[len(pre):] if k.startswith(pre) else k): t for k, t in params.items()}


def mtp_logits_features(params: dict, cfg: qn.Qwen3NextConfig, tokens: torch.Tensor, h: torch.Tensor,
                        positions: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP module on rows (t_{p+1}, h_p): (logits [T, V], next-depth feature hn [T, H]).

    params: :func:`as_layer` of the drafter's params; cfg: :func:`block_config` of the target (the module is
    layer ``cfg.num_hidden_layers - 1``); tokens [T]; h [T, H]; positions [T] (RoPE, p);
    ``attend(q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd], scale) -> [T, Hq, hd]`` stores the rows' KV and
    attends (the draft cache).

    >>> cfg = qn.Qwen3NextConfig.tiny()
    >>> d = Qwen3NextMTPDrafter.random(cfg, qn.init_params(cfg))
    >>> attend = lambda q, k, v, scale: q                  # a stand-in attention
    >>> logits, hn = mtp_logits_features(as_layer(d.params, 4), block_config(cfg), torch.tensor([3, 4]),
    ...                                  torch.randn(2, 48), torch.tensor([0, 1]), attend)
    >>> logits.shape, hn.shape
    (torch.Size([2, 64]), torch.Size([2, 48]))
    """
    p, eps, n = params, cfg.rms_norm_eps, cfg.num_hidden_layers - 1
    e = F.embedding(tokens, p["model.embed_tokens.weight"])  # [T, H]
    x = F.linear(torch.cat([qn.rms_norm_1p(e, p["mtp.pre_fc_norm_embedding.weight"], eps),
                            qn.rms_norm_1p(h.to(e.dtype), p["mtp.pre_fc_norm_hidden.weight"], eps)], -1),
                 p["mtp.fc.weight"])  # [T, H]
    cos, sin = qn.rope_tables(cfg, positions, e.dtype)
    pre = f"model.layers.{n}."
    y = x + qn.attention_block(p, cfg, n, 0, qn.rms_norm_1p(x, p[pre + "input_layernorm.weight"], eps), cos, sin,
                               lambda _slot, q, k, v, scale: attend(q, k, v, scale))
    y = y + qn.mlp_block(p, cfg, n, qn.rms_norm_1p(y, p[pre + "post_attention_layernorm.weight"], eps))
    hn = qn.rms_norm_1p(y, p["mtp.norm.weight"], eps)  # [T, H]
    return F.linear(hn, lm_head(p, cfg)), hn


def mtp_step(state: dict, batch: dict, *, cfg: qn.Qwen3NextConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One capturable draft step over rows (:func:`cpattn.drafters.chain.step_fields`): the rows' K and V
    written to ``state["cache"]`` [2, R + 1, L + 1, Hkv, hd] at (req, pos), each row attending to its
    request's positions ``lo .. hi - 1``. Returns (greedy tokens [T], next features [T, H])."""
    attend = kv.step_attention(state["cache"], batch)
    logits, hn = mtp_logits_features(state["params"], cfg, batch["tokens"], batch["features"], batch["pos"], attend)
    return logits.argmax(-1), hn


@dataclass(frozen=True)
class Qwen3NextMTPDrafter:
    """Qwen3-Next's MTP module as a drafter (module doc). model: the target family (one of :data:`TARGETS`);
    params: ``mtp.*`` under the checkpoint's names plus :data:`SHARED`; cfg: the target's config."""

    model: str
    params: dict
    cfg: Any
    settings: DraftSettings = DraftSettings()
    method: ClassVar[str] = "mtp"
    hidden_layers: ClassVar[tuple] = ()  # reads hidden["norm"] only

    def __post_init__(self):
        if self.model not in TARGETS:
            raise ValueError(f"Qwen3NextMTPDrafter drafts for the hybrid targets {TARGETS}; got model "
                             f"{self.model!r} (DeepSeek-format MTP: cpattn.drafters.mtp.MTPDrafter)")
        need = [*OWN, "model.embed_tokens.weight", *(() if self.cfg.tie_word_embeddings else ("lm_head.weight",)),
                "mtp.layers.0.self_attn.q_proj.weight"]
        missing = [n for n in need if n not in self.params]
        if missing:
            raise ValueError(f"MTP weights lack {missing}: a Qwen3-Next MTP module is mtp.fc, mtp.pre_fc_norm_*, "
                             "mtp.layers.0.*, mtp.norm, with the target's embedding and lm_head")

    @classmethod
    def random(cls, cfg: qn.Qwen3NextConfig, target_params: dict, *, model: str = "qwen3_next", seed: int = 0,
               std: float = 0.02, dtype: torch.dtype | None = None) -> Qwen3NextMTPDrafter:
        """A randomly initialised module (norms at their identity, 0); embedding and head from ``target_params``."""
        dtype = dtype or target_params["model.embed_tokens.weight"].dtype
        ext = block_config(cfg)
        n = cfg.num_hidden_layers
        full = qn.init_params(ext, seed=seed, std=std, dtype=dtype)
        pre = f"model.layers.{n}."
        p = {"mtp.layers.0." + k[len(pre):]: t for k, t in full.items() if k.startswith(pre)}
        g = torch.Generator().manual_seed(seed + 1)
        hs = cfg.hidden_size
        p["mtp.fc.weight"] = (torch.randn(hs, 2 * hs, generator=g) * std).to(dtype)
        for name in OWN[1:]:
            p[name] = torch.zeros(hs, dtype=dtype)
        for name in SHARED:
            if name in target_params:
                p[name] = target_params[name].to(dtype)
        return cls(model, p, cfg)

    @classmethod
    def from_checkpoint(cls, path, *, dtype: torch.dtype | None = None, target=None) -> Qwen3NextMTPDrafter:
        """The MTP module of a Qwen3-Next / Qwen3.5 checkpoint directory (config.json + safetensors): ``mtp.*``
        and the target's embedding and head (from the same directory, else ``target``: a directory or a params
        dict). A config declaring more than one MTP layer is refused (the published checkpoints have one)."""
        from cpattn.models.common import normalize_params
        from cpattn.models.family import get_family

        config = checkpoint.read_config(path)
        family = get_family(config)
        if family.name not in TARGETS:
            raise ValueError(f"{path!r}: a {family.name} checkpoint; Qwen3NextMTPDrafter reads {TARGETS}")
        cfg = family.config_class.from_hf(config)
        text = config.get("text_config", config)
        layers = text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 1))
        if layers != 1:
            raise ValueError(f"{path!r}: config.json declares {layers} MTP layers; cpattn chains one (mtp.layers.0)")
        shared = (*SHARED, *("model.language_model." + n[len("model."):] for n in SHARED))
        _, raw = checkpoint.read(path, prefix="mtp.", names=shared)
        raw = {qn.param_name(k) or k: t for k, t in raw.items()}  # the composite form's language_model names
        if not any(k.startswith("mtp.") for k in raw):
            raise ValueError(f"{path!r}: the checkpoint has no mtp.* tensors (no MTP module)")
        params = normalize_params(raw, dtype=dtype, load_dtype=qn.load_dtype)
        if any(n not in params for n in SHARED) and target is not None:
            extra = target if isinstance(target, dict) else checkpoint.read(target, names=shared)[1]
            extra = {qn.param_name(k) or k: t for k, t in extra.items()}
            for n in SHARED:
                if n not in params and n in extra:
                    params[n] = extra[n] if dtype is None else extra[n].to(dtype)
        if "model.embed_tokens.weight" not in params:
            raise ValueError(f"{path!r}: no model.embed_tokens.weight for the MTP module (it shares the target's); "
                             "pass Qwen3NextMTPDrafter.from_checkpoint(path, target=TARGET_DIR)")
        return cls(family.name, params, cfg)

    def start(self, num_requests: int, max_len: int, *, graph: str | None = None) -> ChainState:
        """A per-rank draft state: the layer's K/V cache for ``num_requests`` x ``max_len`` positions."""
        dtype = self.params["mtp.fc.weight"].dtype
        c = self.cfg
        state = {"params": as_layer(self.params, c.num_hidden_layers),
                 "cache": kv.new_cache(2, requests=num_requests, max_len=max_len, heads=c.num_key_value_heads,
                                       dim=c.head_dim, dtype=dtype)}
        step = functools.partial(mtp_step, cfg=block_config(c))
        return ChainState(step, lambda rows: rows["norm"], state, num_requests=num_requests, max_len=max_len,
                          feature_dim=c.hidden_size, dtype=dtype, graph=graph)
