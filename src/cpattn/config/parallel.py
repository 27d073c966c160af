"""``ParallelConfig``: how many ranks do what (vLLM's ``ParallelConfig``).

DCP reuses TP ranks (no extra ranks); PCP adds ranks:
``world_size_with_pcp = pcp_size * original_world_size``. The guide forbids
PCP and DCP in one engine unless opted in (``allow_pcp_with_dcp``; the
opted-in engine still carries the guide's compatibility note, see
:meth:`cpattn.config.EngineConfig.compat_notes`, which also notes PCP with
DSA-CP: cpattn runs both exactly).

Example
-------
>>> ParallelConfig(tp_size=2, pcp_size=2).world_size_with_pcp
4
>>> ParallelConfig(tp_size=0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
cpattn.config.problems.ConfigError: invalid ParallelConfig (1 problem):
  - tp_size: saw 0; rule: a positive int; fix: pass an int >= 1 as tp_size
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cpattn.config.problems import Checked, positive_ints, problem


@dataclass(frozen=True)
class ParallelConfig(Checked):
    """Parallel sizes of one engine.

    Fields
    ------
    tp_size: tensor-parallel size. pcp_size: prefill context-parallel size.
    dcp_size: decode context-parallel size (reuses TP ranks).
    world_size: the original world size without PCP (default ``tp_size``), a multiple of ``tp_size``.
    enable_dsa_cp: the separate DSA-CP optimization (DSA models only; with PCP: a compatibility note).
    allow_pcp_with_dcp: opt in to PCP and DCP in one engine (the guide forbids it).
    """

    tp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    world_size: int | None = None
    enable_dsa_cp: bool = False
    allow_pcp_with_dcp: bool = False

    @property
    def original_world_size(self) -> int:
        """The world size without PCP: ``world_size``, or ``tp_size`` when it was not given."""
        return self.tp_size if self.world_size is None else self.world_size

    @property
    def world_size_with_pcp(self) -> int:
        """Ranks the engine needs: ``pcp_size * original_world_size`` (PCP adds ranks, DCP does not)."""
        return self.pcp_size * self.original_world_size

    def field_problems(self) -> list[str]:
        return positive_ints(self, ("tp_size", "pcp_size", "dcp_size", "world_size"))

    def rule_problems(self) -> list[str]:
        out = []
        if self.original_world_size % self.tp_size:
            out.append(problem("world_size", f"world_size={self.world_size}, tp_size={self.tp_size}",
                               "the original world size is a multiple of tp_size",
                               f"use world_size={self.tp_size} or another multiple of tp_size"))
        pcp = self.pcp_size
        if pcp > 1 and self.dcp_size > 1 and not self.allow_pcp_with_dcp:
            out.append(problem("pcp_size", f"pcp_size={pcp}, dcp_size={self.dcp_size}",
                               "PCP and DCP cannot both be enabled (the guide's constraint)",
                               "set dcp_size=1 or pcp_size=1, or pass allow_pcp_with_dcp=True to opt in"))
        return out

    def replace(self, **changes) -> ParallelConfig:
        """A copy with ``changes`` applied, validated again.

        >>> ParallelConfig(tp_size=2).replace(pcp_size=2).world_size_with_pcp
        4
        """
        return dataclasses.replace(self, **changes)
