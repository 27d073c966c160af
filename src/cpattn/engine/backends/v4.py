"""The DeepSeek-V4 cache backend: rings plus compressed entries (:class:`cpattn.v4.engine.V4Stages`).

V4's state is not per-token KV rows (``per_token_kv = False``: no cached
prefix, no KV pool); the prefill, the cache, the hand-off payload
(:class:`~cpattn.v4.handoff.V4Handoff`: tail rows and gathered entries) and
the decode program are the family's stages, put behind the
:class:`~cpattn.engine.backend.CacheBackend` seam.

Example
-------
>>> from cpattn.models.family import get_family
>>> b = V4Backend.of(get_family("deepseek_v4"))
>>> b.name, b.per_token_kv, type(b.stages).__name__
('v4', False, 'V4Stages')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cpattn.comm.group import Group
from cpattn.engine.handoff import HandoffFacts
from cpattn.engine.options import Algorithms
from cpattn.v4.engine import V4DecodeCache, V4DecodeProgram, V4Stages
from cpattn.v4.handoff import V4Handoff
from cpattn.v4.prefill import V4PrefillOut
from cpattn.dcp.layer_merges import ENGINE_MERGE


@dataclass(frozen=True)
class V4Backend:
    """The ``"v4"`` cache kind over ``stages`` (a :class:`~cpattn.v4.engine.V4Stages`)."""

    stages: Any
    name = "v4"
    per_token_kv = False

    @classmethod
    def of(cls, family) -> V4Backend:
        """The backend of a family declaring ``cache="v4"``: its ``stages`` if it carries them (the deprecated
        declaration), else :class:`~cpattn.v4.engine.V4Stages` over its forward."""
        legacy = family.stages
        return cls(V4Stages(family.forward) if legacy is None else legacy)

    def prefill(self, group: Group, family, params: dict, cfg: Any, prompts, *, algorithms: Algorithms = Algorithms(),
                prompt_logits: bool = False, prefix=None, hidden_layers=None) -> V4PrefillOut:
        return self.stages.prefill(group, params, cfg, prompts, algorithms=algorithms, prompt_logits=prompt_logits,
                                   prefix=prefix, hidden_layers=hidden_layers)

    def new_cache(self, family, cfg: Any, params: dict, prompts, steps: int, decode_cfg, num_speculative_tokens: int,
                  group: Group | None = None) -> V4DecodeCache:
        if group is None:
            from cpattn.comm.sim import SimMesh

            group = SimMesh(1).groups()[0]
        return self.stages.new_cache(cfg, params, prompts, steps, decode_cfg, num_speculative_tokens, group)

    def collect(self, prefill_group: Group, out: V4PrefillOut) -> V4Handoff:
        return self.stages.collect(prefill_group, out)

    def place(self, cache: V4DecodeCache, collected: V4Handoff, decode_group: Group | None = None) -> None:
        self.stages.place(cache, collected)

    def handoff(self, world: Group, prefill_group: Group, decode_group: Group, cache: V4DecodeCache,
                out: V4PrefillOut, algorithms: Algorithms = Algorithms(), prefix=None) -> HandoffFacts:
        return self.stages.handoff(prefill_group, cache, out)

    def send(self, world: Group, prefill_group: Group, out: V4PrefillOut, decode_ranks: list[int],
             block_size: int) -> HandoffFacts:
        """Every prefill rank collects; prefill rank 0 sends the hand-off and first-token logits."""
        return self.stages.send(prefill_group, out, decode_ranks, world=world)

    def recv(self, world: Group, cache: V4DecodeCache, prompts, cfg: Any, *, prefill_ranks: list[int],
             decode_group: Group, dtype: torch.dtype):
        return self.stages.recv(cache, prompts, src=prefill_ranks[0], world=world)

    def program(self, group: Group, family, params: dict, cfg: Any, cache: V4DecodeCache, *, merge: str = ENGINE_MERGE,
                hidden_layers: tuple | None = None) -> V4DecodeProgram:
        return self.stages.decode_program(group, params, cfg, cache, merge=merge, hidden_layers=hidden_layers)
