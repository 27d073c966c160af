"""``ModelFamily``: what a model family declares so the engine can prefill, hand off and decode it.

This declaration is the models' side of the seam: it imports nothing from
:mod:`cpattn.engine`, which stands above it (the engine registers its cache
backends here, :func:`register_backends`). Old path ``cpattn.models.family``
still re-exports every name.

A family is one file in :mod:`cpattn.models` that defines pure functions
and one ``FAMILY = ModelFamily(...)`` naming them. The engine reads only
this declaration: it never sniffs module names or config attributes.

- ``forward(params, cfg, tokens, attn, *, logits_index=None, hidden_layers=None)``:
  tokens [T] int64 of one step, ``attn`` an attention step (the engine's,
  see :class:`cpattn.models.common.Attention`); returns logits
  [T or len(logits_index), V]. With ``hidden_layers`` (a tuple of layer
  indices, possibly empty) it returns ``(logits, hidden)`` where
  ``hidden["norm"]`` is the final-normed hidden state [T, H] (what MTP
  drafters read) and ``hidden[i]`` the residual stream after layer i
  (what Eagle3 / DSpark fuse).
- ``init_params(cfg, *, seed, std, dtype)``: random weights with the Hugging Face names.
- ``config_class.from_hf(config)``: the family's config from a transformers
  config, a config.json dict or a checkpoint path.
- ``kv_layouts(cfg)``: one :class:`KVLayout` per layer (what a token
  leaves in that layer's cache, so what a hand-off moves).
- ``attention``: "gqa", "mla", "dsa" or "v4" (the guide's attention kinds;
  DSA prefill runs as DSA-CP over a token split, the others as PCP).
- ``capturable``: the decode step has no data-dependent shapes or host
  syncs, so graph backends other than "eager" can capture it.
- ``rename`` (optional): how the family's checkpoints name tensors, one
  checkpoint name -> its params name, or None for a tensor the model does
  not read (DeepSeek-V4's original names and MTP layers:
  :func:`cpattn.models.deepseek_v4_checkpoint.param_name`); None: checkpoint names are params
  names. :func:`cpattn.models.load_checkpoint` applies it before checking
  names and shapes against ``init_params``, so the CLI and the API load alike.
- ``load_dtype`` (optional): ``load_dtype(params name, dtype)`` -> the dtype
  that tensor takes when a checkpoint is loaded in ``dtype`` (None: as
  stored); None: the default rule of :func:`cpattn.models.normalize_params`
  (routers, correction biases and DSA ``weights_proj`` as stored).
- ``cache``: the family's KV cache kind, ``"paged"`` (default: per-token
  ``KVLayout`` rows in the engine's paged cache), ``"v4"`` (DeepSeek-V4's
  rings and compressed entries) or ``"hybrid"`` (paged KV for the full
  attention layers plus a per-request recurrent state for the linear ones:
  Qwen3-Next); the engine serves it through that kind's backend
  (``family.backend``, :mod:`cpattn.engine.backend`; kinds: :data:`CACHE_KINDS`).
- ``recurrent_cache`` (the ``"hybrid"`` kind only): ``recurrent_cache(cfg, *,
  batch, dtype, device)`` -> the linear layers' zero states for ``batch``
  requests (a :class:`cpattn.linear.state.RecurrentCache`); the hybrid
  family's forward then takes the linear step as its fifth argument,
  ``forward(params, cfg, tokens, attn, lin, *, logits_index=None)``.
- ``draft_target`` (optional): ``draft_target(cfg)`` -> the
  :class:`~cpattn.models.draft_target.DraftTarget` drafters size their
  layers from (hidden row width, MLP size, draft heads, RoPE, the kinds of
  an MTP layer N); None: no drafter reads this family's hidden rows.
- ``stages`` (deprecated, optional): the old way to declare DeepSeek-V4's
  kind, a :class:`cpattn.v4.engine.V4Stages`; a family passing it is taken
  as ``cache="v4"`` and its V4 backend runs over those stages. Declare
  ``cache="v4"`` instead.

Example
-------
>>> from cpattn.models.family import get_family
>>> fam = get_family("qwen3")
>>> fam.attention, fam.capturable
('gqa', True)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from cpattn.config import ModelConfig
from cpattn.ops.logits import param_dtype

# model_type -> the module that defines FAMILY (imported on first use)
FAMILY_MODULES = {
    "qwen3": "cpattn.models.qwen3",
    "qwen3_moe": "cpattn.models.qwen3_moe",
    "deepseek_v2": "cpattn.models.deepseek_v2",
    "deepseek_v3": "cpattn.models.deepseek_v3",
    "deepseek_v32": "cpattn.models.deepseek_v32",
    "glm_moe_dsa": "cpattn.models.glm_moe_dsa",
    "deepseek_v4": "cpattn.models.deepseek_v4",
    "qwen3_next": "cpattn.models.qwen3_next",
    "qwen3_5": "cpattn.models.qwen3_5",
    "qwen3_5_moe": "cpattn.models.qwen3_5_moe",
}

# the KV cache kinds a family may declare (``ModelFamily.cache``); the engine serves each by a backend
CACHE_KINDS = ("paged", "v4", "hybrid")

# kind lookup ``family -> CacheBackend``, registered by :mod:`cpattn.engine.backend` when the engine loads
_backend_for: Callable[[Any], Any] | None = None


def register_backends(lookup: Callable[[Any], Any]) -> None:
    """Register the engine's ``family -> CacheBackend`` lookup (:func:`cpattn.engine.backend.backend_for`);
    the engine calls this when it loads, so :attr:`ModelFamily.backend` needs no import upward."""
    global _backend_for
    _backend_for = lookup


@dataclass(frozen=True)
class KVLayout:
    """What one token leaves in one layer's KV cache.

    num_kv_heads, head_dim (key width per head), v_head_dim (value width);
    values_in_keys: values are ``keys[..., :v_head_dim]`` (the MLA latent
    row ``[latent | rope]``, one head), so there is no value cache;
    index_head_dim: width of the DSA indexer key (0: no indexer cache).

    >>> KVLayout(1, 576, 512, values_in_keys=True, index_head_dim=128).row_width
    704
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    values_in_keys: bool = False
    index_head_dim: int = 0

    @property
    def row_width(self) -> int:
        """Elements of one token's row in this layer: keys, values unless in keys, indexer key."""
        values = 0 if self.values_in_keys else self.num_kv_heads * self.v_head_dim
        return self.num_kv_heads * self.head_dim + values + self.index_head_dim


def nan_caches(layouts: tuple[KVLayout, ...], lead: tuple[int, ...], dtype: torch.dtype, device) -> tuple:
    """Per-layer caches ``(k, v, k_index)`` of leading shape ``lead``, filled with NaN (never to be read
    unwritten): k [*lead, Hkv, Dk]; v [*lead, Hkv, Dv] or None (values in keys); k_index [*lead, D_I] or None.

    >>> k, v, ki = nan_caches((KVLayout(2, 8, 4),), (3, 16), torch.float32, "cpu")
    >>> k[0].shape, v[0].shape, ki, bool(k[0].isnan().all())
    (torch.Size([3, 16, 2, 8]), torch.Size([3, 16, 2, 4]), (None,), True)
    """
    def nan(*shape):
        return torch.full((*lead, *shape), float("nan"), dtype=dtype, device=device)

    k = tuple(nan(lay.num_kv_heads, lay.head_dim) for lay in layouts)
    v = tuple(None if lay.values_in_keys else nan(lay.num_kv_heads, lay.v_head_dim) for lay in layouts)
    ki = tuple(nan(lay.index_head_dim) if lay.index_head_dim else None for lay in layouts)
    return k, v, ki


@dataclass(frozen=True)
class ModelFamily:
    """One model family's declaration (see module doc)."""

    name: str
    config_class: type
    attention: str
    forward: Callable[..., Any]
    init_params: Callable[..., dict]
    kv_layouts: Callable[[Any], tuple[KVLayout, ...]]
    capturable: bool = False
    stages: Any = None
    rename: Callable[[str], str | None] | None = None
    load_dtype: Callable[[str, torch.dtype], torch.dtype | None] | None = None
    cache: str = "paged"
    recurrent_cache: Callable[..., Any] | None = None
    draft_target: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        legacy = self.stages  # the deprecated declaration of DeepSeek-V4's kind
        if legacy is not None and self.cache == "paged":
            object.__setattr__(self, "cache", "v4")
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"ModelFamily {self.name!r}: cache={self.cache!r} is not a cache kind; expected one "
                             f"of {CACHE_KINDS}")
        if (self.cache == "hybrid") != (self.recurrent_cache is not None):
            raise ValueError(f"ModelFamily {self.name!r}: cache={self.cache!r} with recurrent_cache="
                             f"{self.recurrent_cache!r}; a 'hybrid' family declares recurrent_cache (its linear "
                             "layers' states) and no other kind does; pass both or neither")

    @property
    def backend(self):
        """The :class:`~cpattn.engine.backend.CacheBackend` of the family's ``cache`` kind.

        >>> import cpattn.engine  # registers the backends
        >>> get_family("qwen3").backend.name, get_family("deepseek_v4").backend.per_token_kv
        ('paged', False)
        """
        if _backend_for is None:
            raise ValueError(f"ModelFamily {self.name!r}: .backend needs the engine's cache backends, none is "
                             "registered; import cpattn.engine first (it registers them)")
        return _backend_for(self)

    def param_name(self, name: str) -> str | None:
        """The params name of checkpoint tensor ``name`` (None: not loaded), by the family's ``rename``.

        >>> get_family("qwen3").param_name("model.norm.weight")
        'model.norm.weight'
        >>> get_family("deepseek_v4").param_name("layers.0.hc_attn_fn")
        'model.layers.0.attn_hc.fn'
        """
        return name if self.rename is None else self.rename(name)

    def model_config(self, cfg: Any) -> ModelConfig:
        """The :class:`~cpattn.config.ModelConfig` of a family config, as the engine lays it out.

        The engine keeps every KV head on every rank of a DCP group (TP splits
        only the query heads), hence ``tp_splits_kv_heads=False``.
        """
        layout = self.kv_layouts(cfg)[0]
        return ModelConfig(attention=self.attention, num_attention_heads=cfg.num_attention_heads,
                           num_kv_heads=layout.num_kv_heads, tp_splits_kv_heads=False)


def get_family(model: ModelFamily | ModuleType | str | dict | Any) -> ModelFamily:
    """A family by itself, its module (``FAMILY``), its ``model_type`` name, a config dict's ``model_type``,
    or one of its configs (the family whose ``config_class`` is nearest in the config's class MRO).

    >>> get_family({"model_type": "deepseek_v32"}).attention
    'dsa'
    >>> from cpattn.models.glm_moe_dsa import GlmMoeDsaConfig
    >>> get_family(GlmMoeDsaConfig.tiny()).name
    'glm_moe_dsa'
    """
    if isinstance(model, ModelFamily):
        return model
    if isinstance(model, ModuleType):
        return model.FAMILY
    if model is not None and not isinstance(model, (str, dict)):
        return family_of_config(model)
    name = model.get("model_type") if isinstance(model, dict) else model
    if name not in FAMILY_MODULES:
        raise ValueError(f"model_type {name!r} is not supported; supported: {sorted(FAMILY_MODULES)}")
    return importlib.import_module(FAMILY_MODULES[name]).FAMILY


def family_of_config(cfg: Any) -> ModelFamily:
    """The family a config belongs to: the one whose ``config_class`` is nearest in ``type(cfg).__mro__``
    (a family's config may subclass another's: GLM-5's is DeepSeek-V3.2's, V3.2's is V3's).

    >>> from cpattn.models.deepseek_v32 import DeepseekV32Config
    >>> family_of_config(DeepseekV32Config.tiny()).name
    'deepseek_v32'
    """
    families = [get_family(name) for name in FAMILY_MODULES]
    for cls in type(cfg).__mro__:
        for fam in families:
            if fam.config_class is cls:
                return fam
    raise ValueError(f"{type(cfg).__name__} is no family's config; supported families: {sorted(FAMILY_MODULES)} "
                     "(pass a config of one of them, e.g. cpattn.models.qwen3.Qwen3Config)")
