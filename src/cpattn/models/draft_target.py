"""``DraftTarget``: what a model family declares for the drafters that speculate for it.

A drafter (Eagle3, DSpark, MTP) sizes its own layer from its target's: the
width of one hidden row it fuses, its MLP size, attention heads, RoPE, and,
for an MTP module that runs as the target's layer N, the kind that extra
layer takes in each per-layer field. A family declares these once
(``ModelFamily.draft_target``, see :mod:`cpattn.models.family`), so the
drafters never sniff config types or attributes.

Example
-------
>>> from cpattn.models.family import get_family
>>> from cpattn.models.deepseek_v4 import DeepseekV4Config
>>> t = get_family("deepseek_v4").draft_target(DeepseekV4Config.tiny())
>>> t.hidden_size, t.row_width, t.intermediate_size, t.attention_shape
(32, 64, 16, (4, 2, 8))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DraftTarget:
    """What a drafter takes from a target config (one per config, from its family's ``draft_target``).

    hidden_size: H, the target's model width; row_width: elements of one layer's hidden row that a
    drafter fuses (H, or DeepSeek-V4's ``hc_mult`` streams flattened, ``n_hc * H``);
    intermediate_size: a draft layer's dense MLP size; num_attention_heads, num_key_value_heads,
    head_dim: a draft layer's GQA shape (the target's own, or :func:`paired_heads` for a target
    without GQA fields); rope, max_position_embeddings, rms_norm_eps: a draft layer's RoPE table,
    positions and norm eps; mtp_layer: per-layer field name -> the kind the target's MTP module takes
    as an extra layer N (None: the family declares no MTP module).

    >>> t = DraftTarget(16, 16, 32, 2, 1, 8, {"rope_theta": 1e6}, 64, 1e-6, {"mlp_layer_types": "dense"})
    >>> t.attention_shape
    (2, 1, 8)
    """

    hidden_size: int
    row_width: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: dict
    max_position_embeddings: int
    rms_norm_eps: float
    mtp_layer: dict[str, str] | None = None

    @property
    def attention_shape(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim) of a draft layer."""
        return self.num_attention_heads, self.num_key_value_heads, self.head_dim

    def extend(self, cfg: Any) -> Any:
        """``cfg`` (the config this target came from) with the MTP module as one more layer N: each per-layer
        field of :attr:`mtp_layer` gains its kind and ``num_hidden_layers`` grows by one.

        >>> from cpattn.models.deepseek_v3 import DeepseekV3Config
        >>> cfg = DeepseekV3Config.tiny()
        >>> mla_target(cfg).extend(cfg).mlp_layer_types
        ('dense', 'sparse', 'sparse')
        """
        if self.mtp_layer is None:
            raise ValueError(f"{type(cfg).__name__}: its family declares no MTP layer (DraftTarget.mtp_layer is "
                             "None); an MTP drafter needs a target whose checkpoints carry one")
        extra = {name: (*getattr(cfg, name), kind) for name, kind in self.mtp_layer.items()}
        return dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 1, **extra)


def target_of(cfg: Any) -> DraftTarget:
    """The :class:`DraftTarget` of a family config, as its family declares it (``ModelFamily.draft_target``).

    >>> from cpattn.models.qwen3_next import Qwen3NextConfig
    >>> target_of(Qwen3NextConfig.tiny()).attention_shape
    (4, 1, 16)
    """
    from cpattn.models.family import get_family

    family = get_family(cfg)
    if family.draft_target is None:
        raise ValueError(f"family {family.name!r} declares no draft_target, so no drafter can size itself from its "
                         "config; declare ModelFamily(draft_target=...) in its module")
    return family.draft_target(cfg)


def paired_heads(cfg: Any) -> tuple[int, int, int]:
    """Draft heads for a target without a GQA shape (MLA, V4): its query heads, two per KV head,
    ``hidden / heads`` wide.

    >>> from cpattn.models.deepseek_v3 import DeepseekV3Config
    >>> paired_heads(DeepseekV3Config.tiny())
    (4, 2, 16)
    """
    heads = cfg.num_attention_heads
    return heads, max(1, heads // 2), cfg.hidden_size // heads


def dense_target(cfg: Any, heads: tuple[int, int, int], mtp_layer: dict[str, str] | None = None) -> DraftTarget:
    """The target of a config with ``[H]`` rows, a dense ``intermediate_size`` and one ``rope`` table."""
    return DraftTarget(hidden_size=cfg.hidden_size, row_width=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=heads[2],
                       rope=dict(cfg.rope), max_position_embeddings=cfg.max_position_embeddings,
                       rms_norm_eps=cfg.rms_norm_eps, mtp_layer=mtp_layer)


def gqa_target(cfg: Any) -> DraftTarget:
    """Qwen3 / Qwen3-MoE: the target's own GQA shape, no MTP module.

    >>> from cpattn.models.qwen3 import Qwen3Config
    >>> gqa_target(Qwen3Config.tiny()).attention_shape
    (4, 1, 32)
    """
    return dense_target(cfg, (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim))


def mla_target(cfg: Any) -> DraftTarget:
    """DeepSeek-V2 / V3 / V3.2: :func:`paired_heads`; the MTP layer's MLP is MoE when the target has routed
    experts.

    >>> from cpattn.models.deepseek_v3 import DeepseekV3Config
    >>> mla_target(DeepseekV3Config.tiny()).mtp_layer
    {'mlp_layer_types': 'sparse'}
    """
    return dense_target(cfg, paired_heads(cfg), {"mlp_layer_types": "sparse" if cfg.n_routed_experts else "dense"})
