"""A DSpark head's shape (:class:`DSparkConfig`) and what it takes from its target (:func:`target_sizes`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cpattn.models.draft_target import target_of


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
        """A head for a target: its sizes (:func:`target_sizes`; heads as its family declares them,
        :attr:`~cpattn.models.draft_target.DraftTarget.attention_shape`); fused layers default to (0, n // 2 - 1, n - 2).

        >>> from cpattn.models.deepseek_v4 import DeepseekV4Config
        >>> c = DSparkConfig.for_target(DeepseekV4Config.tiny(), block_size=4, mask_token_id=63)
        >>> c.target_layer_ids, c.target_hidden_size, c.feature_size, c.intermediate_size   # 2 streams of 32
        ((0, 1), 64, 128, 16)
        """
        n = cfg.num_hidden_layers
        ids = target_layer_ids or tuple(sorted({0, max(n // 2 - 1, 0), max(n - 2, 0)}))
        heads, kv_heads, head_dim = target_of(cfg).attention_shape
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
    vocabulary and heads, as the target's family declares them
    (:class:`~cpattn.models.draft_target.DraftTarget`): the width of one fused layer's row, the draft MLP's
    size, RoPE, positions, eps.

    A DeepSeek-V4 layer's row is its ``hc_mult`` streams flattened (``n_hc * H``); V4 has no dense MLP, so
    the draft layer takes the experts' size (``moe_intermediate_size``), and the sliding layers' RoPE
    (``rope_main``: plain, without the compressed layers' YaRN). Qwen3 / DeepSeek-V3: [H] rows, their own
    ``intermediate_size`` and ``rope``.

    >>> from cpattn.models.deepseek_v4 import DeepseekV4Config
    >>> s = target_sizes(DeepseekV4Config.tiny())
    >>> s["target_hidden_size"], s["intermediate_size"], s["rope"]["rope_theta"], s["max_position_embeddings"]
    (64, 16, 10000.0, 256)
    """
    t = target_of(cfg)
    return {"target_hidden_size": t.row_width, "intermediate_size": t.intermediate_size, "rope": dict(t.rope),
            "max_position_embeddings": t.max_position_embeddings, "rms_norm_eps": t.rms_norm_eps}


def check_features(cfg: DSparkConfig, n: int) -> None:
    """Raise unless ``n`` features per position are what this head's fc reads (:attr:`DSparkConfig.feature_size`).

    >>> check_features(DSparkConfig(16, 32, 1, 2, 1, 8, 32, (0, 2), 2, 31, 4), 32)
    """
    if n != cfg.feature_size:
        raise ValueError(f"the target's rows of layers {cfg.target_layer_ids} have {n} features per position; this "
                         f"head's fc reads {cfg.feature_size} (target_hidden_size={cfg.target_hidden_size} per "
                         f"layer): it was made for another target (DSparkConfig.for_target)")

