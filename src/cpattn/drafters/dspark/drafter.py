"""The DSpark head as a drafter: built at random or from a checkpoint, saved, started per rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cpattn.drafters import checkpoint
from cpattn.drafters.dspark.config import DSparkConfig
from cpattn.drafters.dspark.init import random_params
from cpattn.drafters.dspark.state import DSparkState
from cpattn.engine.drafters import DraftSettings


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
        return cls(random_params(target_params, cfg, seed=seed, std=std, dtype=dtype), cfg)

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
