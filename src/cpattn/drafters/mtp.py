"""MTP: DeepSeek's multi-token-prediction module as a drafter (DeepSeek-V3 / V3.2 / GLM-5 targets).

The module shipped with a DeepSeek-V3-format checkpoint as layer
``N = num_hidden_layers`` (``model.layers.61.*`` in DeepSeek-V3) predicts
the token after next from the target's hidden state and the next token's
embedding, embedding first as real checkpoints and Hugging Face order it::

    x   = eh_proj([enorm(emb(t_{p+1})) ; hnorm(h_p)])       # [2H] -> [H]
    y   = block(x)                                          # one MLA + MoE decoder layer, RoPE at p + 1
    hn  = shared_head.norm(y)                               # [H]
    t_{p+2} = argmax(shared_head.head(hn))

``h_p`` is the target's final-normed hidden state (what HF feeds). Drafting
k > 1 tokens chains the one module on its own output, feeding ``hn`` as the
next depth's ``h`` (as HF chains MTP layers), through the same draft cache:
see :mod:`cpattn.drafters.chain`. The block's attention is dense absorbed
MLA over the drafter's own latent cache (a DSA target's MTP indexer is not
used: dense draft attention, as the guide requires with PCP).

Weights: the checkpoint's own names (experts stacked); ``embed_tokens`` and
``shared_head.head`` fall back to the target's ``model.embed_tokens`` /
``lm_head`` when the module has none (HF shares them the same way).

Example
-------
>>> from cpattn.models import deepseek_v3 as ds
>>> cfg = ds.DeepseekV3Config.tiny()
>>> d = MTPDrafter.random("deepseek_v3", cfg, target_params=ds.init_params(cfg), seed=0)
>>> d.layer, d.hidden_layers, "model.layers.2.eh_proj.weight" in d.params
(2, (), True)
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
from cpattn.models.draft_target import target_of
from cpattn.models.family import get_family
from cpattn.models import deepseek_v3 as v3
from cpattn.models.common import rms_norm, rope_cos_sin, rope_inv_freq

TARGETS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")  # families whose checkpoints carry DeepSeek's MTP module


def block_config(cfg: Any) -> Any:
    """The target config extended by the MTP layer N, each per-layer field as its family declares that layer
    (:attr:`~cpattn.models.draft_target.DraftTarget.mtp_layer`: MoE MLP when the target has routed experts;
    GLM-5's indexer kind "full").

    >>> block_config(v3.DeepseekV3Config.tiny()).mlp_layer_types
    ('dense', 'sparse', 'sparse')
    """
    return target_of(cfg).extend(cfg)


def mtp_logits_features(params: dict, cfg: Any, layer: int, tokens: torch.Tensor, h: torch.Tensor,
                        positions: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP module on rows (t_{p+1}, h_p): (logits [T, V], next-depth feature hn [T, H]).

    cfg: :func:`block_config` of the target; tokens: [T]; h: [T, H];
    positions: [T] RoPE positions (p + 1); ``attend(q [T, Hq, r + rope], kv
    [T, 1, r + rope], scale) -> [T, Hq, r]`` stores the rows' latent KV and
    attends (the draft cache at inference, a causal mask in training).

    >>> cfg = v3.DeepseekV3Config.tiny()
    >>> d = MTPDrafter.random("deepseek_v3", cfg)
    >>> attend = lambda q, lat, scale: q[..., : cfg.kv_lora_rank]      # a stand-in attention
    >>> logits, hn = mtp_logits_features(d.params, block_config(cfg), 2, torch.tensor([3, 4]), torch.randn(2, 64),
    ...                                  torch.tensor([1, 2]), attend)
    >>> logits.shape, hn.shape
    (torch.Size([2, 64]), torch.Size([2, 64]))
    """
    pre = f"model.layers.{layer}."
    p, eps = params, cfg.rms_norm_eps
    e = F.embedding(tokens, p[pre + "embed_tokens.weight"])  # [T, H]
    x = F.linear(torch.cat([rms_norm(e, p[pre + "enorm.weight"], eps), rms_norm(h.to(e.dtype), p[pre + "hnorm.weight"],
                                                                                   eps)], -1),
                 p[pre + "eh_proj.weight"])  # [T, H]
    dtype = torch.promote_types(x.dtype, torch.float32) if cfg.rope_float32 else x.dtype
    inv_freq, att = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings)
    cos, sin = rope_cos_sin(positions, inv_freq, att, dtype)  # [T, rope / 2]
    q, lat, _ = v3.mla_project(p, cfg, pre + "self_attn.", rms_norm(x, p[pre + "input_layernorm.weight"], eps), cos,
                               sin)
    x = x + v3.mla_output(p, cfg, pre + "self_attn.", attend(q, lat, cfg.softmax_scale))
    x = x + v3.mlp(p, cfg, layer, rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps))
    hn = rms_norm(x, p[pre + "shared_head.norm.weight"], eps)  # [T, H]
    return F.linear(hn, p[pre + "shared_head.head.weight"]), hn


def mtp_step(state: dict, batch: dict, *, cfg: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One capturable draft step over rows (see :func:`cpattn.drafters.chain.step_fields`).

    state: ``{"params": MTP weights, "cache": [1, R + 1, L + 1, 1, r + rope]}``.
    Returns (greedy tokens [T], next features [T, H]).

    >>> cfg = v3.DeepseekV3Config.tiny()
    >>> state = MTPDrafter.random("deepseek_v3", cfg).start(1, 8).state
    >>> one = torch.tensor([0])
    >>> batch = {"tokens": torch.tensor([5]), "features": torch.randn(1, 64), "req": one, "pos": one, "lo": one,
    ...          "hi": one + 1}
    >>> [t.shape for t in mtp_step(state, batch, cfg=block_config(cfg), layer=2)]
    [torch.Size([1]), torch.Size([1, 64])]
    """
    cache = state["cache"][0]
    r = cfg.kv_lora_rank

    def attend(q, lat, scale):
        kv.write(cache, batch["req"], batch["pos"], lat)
        return kv.attend(q, cache, cache, batch["req"], batch["lo"], batch["hi"], scale, v_head_dim=r)

    logits, hn = mtp_logits_features(state["params"], cfg, layer, batch["tokens"], batch["features"],
                                     batch["pos"] + 1, attend)
    return logits.argmax(-1), hn


@dataclass(frozen=True)
class MTPDrafter:
    """DeepSeek's MTP module as a drafter (see module doc).

    model: the target family's name (one of :data:`TARGETS`); params: the
    module's tensors under their checkpoint names ``model.layers.{N}.*``
    (experts stacked); cfg: the target's family config (N = its
    ``num_hidden_layers``).
    """

    model: str
    params: dict
    cfg: Any
    settings: DraftSettings = DraftSettings()
    method: ClassVar[str] = "mtp"
    hidden_layers: ClassVar[tuple] = ()  # reads hidden["norm"] only

    def __post_init__(self):
        if self.model not in TARGETS:
            raise ValueError(f"MTP drafts for DeepSeek-format MLA/DSA targets {TARGETS}; got model {self.model!r}")
        need = [f"model.layers.{self.layer}.{n}" for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                           "shared_head.norm.weight", "shared_head.head.weight",
                                                           "embed_tokens.weight")]
        missing = [n for n in need if n not in self.params]
        if missing:
            raise ValueError(f"MTP weights lack {missing}; a DeepSeek-V3-format module is model.layers.{self.layer}.*")

    @property
    def layer(self) -> int:
        """N: the module's layer index in the checkpoint (the target's layer count)."""
        return self.cfg.num_hidden_layers

    @classmethod
    def from_checkpoint(cls, path, *, dtype: torch.dtype | None = None, target=None) -> MTPDrafter:
        """The MTP module of a DeepSeek-V3-format checkpoint directory (config.json + safetensors); a
        Qwen3-Next / Qwen3.5 checkpoint gives :class:`~cpattn.drafters.qwen3_next_mtp.Qwen3NextMTPDrafter`.

        Loads only ``model.layers.{N}.*``. The module's embedding and head are its own
        ``model.layers.{N}.embed_tokens`` / ``shared_head.head`` (``cpattn train-draft`` writes both), else
        the checkpoint's ``model.embed_tokens`` / ``lm_head`` (a whole target checkpoint), else ``target``'s:
        a target checkpoint directory or its params dict (HF shares them the same way). Missing everywhere:
        a one-line ``ValueError`` naming the directory and the tensor.
        """
        from cpattn.models.common import normalize_params

        config = checkpoint.read_config(path)
        family = get_family(config)
        from cpattn.drafters import qwen3_next_mtp

        if family.name in qwen3_next_mtp.TARGETS:  # a hybrid checkpoint's mtp.* module: its own drafter
            return qwen3_next_mtp.Qwen3NextMTPDrafter.from_checkpoint(path, dtype=dtype, target=target)
        cfg = family.config_class.from_hf(config)
        n = cfg.num_hidden_layers
        if not config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)):
            raise ValueError(f"{path!r}: config.json declares no MTP module (num_nextn_predict_layers = 0)")
        shared = ("model.embed_tokens.weight", "lm_head.weight")
        _, raw = checkpoint.read(path, prefix=f"model.layers.{n}.", names=shared)
        params = normalize_params(raw, dtype=dtype)
        pre = f"model.layers.{n}."
        want = {pre + "embed_tokens.weight": ("model.embed_tokens.weight",),
                pre + "shared_head.head.weight": ("lm_head.weight", "model.embed_tokens.weight")}
        if any(k not in params for k in want) and target is not None:
            if isinstance(target, dict):
                extra = target
            else:
                _, extra = checkpoint.read(target, names=shared)
            extra = {k: (t.to(dtype) if dtype is not None else t) for k, t in extra.items() if k in shared}
            params = {**extra, **{k: t for k, t in params.items() if k not in extra}}
        for name, sources in want.items():
            if name not in params:
                found = next((params[s] for s in sources if s in params), None)
                if found is None:
                    where = "" if target is None else " (nor does the target given)"
                    raise ValueError(
                        f"{path!r}: the MTP module has no {name} and the checkpoint no {' or '.join(sources)}{where}; "
                        "the module shares the target's embedding and head: pass "
                        "MTPDrafter.from_checkpoint(path, target=TARGET_DIR)")
                params[name] = found
        keep = {k: t for k, t in params.items() if k.startswith(pre)}
        return cls(family.name, keep, cfg)

    @classmethod
    def random(cls, model: str, cfg: Any, *, target_params: dict | None = None, seed: int = 0, std: float = 0.02,
               dtype: torch.dtype = torch.float32) -> MTPDrafter:
        """A randomly initialised module (norms at 1); embedding and head copied from ``target_params``."""
        family = get_family(model)
        ext = block_config(cfg)
        n = cfg.num_hidden_layers
        full = family.init_params(ext, seed=seed, std=std, dtype=dtype)
        pre = f"model.layers.{n}."
        p = {k: t for k, t in full.items() if k.startswith(pre)}
        g = torch.Generator().manual_seed(seed + 1)
        hs = cfg.hidden_size
        p[pre + "enorm.weight"] = torch.ones(hs, dtype=dtype)
        p[pre + "hnorm.weight"] = torch.ones(hs, dtype=dtype)
        p[pre + "shared_head.norm.weight"] = torch.ones(hs, dtype=dtype)
        p[pre + "eh_proj.weight"] = (torch.randn(hs, 2 * hs, generator=g) * std).to(dtype)
        src = target_params if target_params is not None else full
        p[pre + "embed_tokens.weight"] = src["model.embed_tokens.weight"].to(dtype).clone()
        head = src.get("lm_head.weight", src["model.embed_tokens.weight"])
        p[pre + "shared_head.head.weight"] = head.to(dtype).clone()
        return cls(family.name, p, cfg)

    def save(self, path, config: dict, dtype: torch.dtype | None = None) -> None:
        """Write the module as a DeepSeek-V3-format checkpoint (per-expert names) with the target's
        ``config`` (a config.json dict; ``num_nextn_predict_layers`` is set to 1)."""
        checkpoint.save(path, checkpoint.unstack_experts(self.params), {**config, "num_nextn_predict_layers": 1},
                        dtype=dtype)

    def start(self, num_requests: int, max_len: int, *, graph: str | None = None) -> ChainState:
        """A per-rank draft state: the module's latent cache for ``num_requests`` x ``max_len`` positions."""
        dtype = self.params[f"model.layers.{self.layer}.eh_proj.weight"].dtype
        width = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
        state = {"params": self.params,
                 "cache": kv.new_cache(1, requests=num_requests, max_len=max_len, heads=1, dim=width, dtype=dtype)}
        step = functools.partial(mtp_step, cfg=block_config(self.cfg), layer=self.layer)
        return ChainState(step, lambda rows: rows["norm"], state, num_requests=num_requests, max_len=max_len,
                          feature_dim=self.cfg.hidden_size, dtype=dtype, graph=graph)
