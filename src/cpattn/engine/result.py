"""What a run returns: the tokens, the logits they came from, and what each rank did to get them.

Example
-------
>>> import torch
>>> g = Generation(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, 4), None, SpecStats(), RunFacts())
>>> g.tokens.shape, g.facts.ttft_s
(torch.Size([1, 2]), 0.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpattn.engine.decode import SpecStats
from cpattn.engine.handoff import HandoffFacts
from cpattn.engine.pooling import PoolFacts


@dataclass(frozen=True)
class RunFacts:
    """One rank's measurements: ttft_s (start -> first tokens known and their KV in the decode cache),
    prefill_s, step_s (each decode step), bytes_sent per phase ("prefill", "handoff", "decode"),
    kv_bytes (this rank's decode cache), handoff (:class:`~cpattn.engine.handoff.HandoffFacts`),
    runner (graph mode: the DecodeRunner's stats), role ("prefill", "decode" or "both"),
    pool (:class:`~cpattn.engine.pooling.PoolFacts`: blocks found, loaded and stored)."""

    ttft_s: float = 0.0
    prefill_s: float = 0.0
    step_s: tuple[float, ...] = ()
    bytes_sent: dict = field(default_factory=dict)
    kv_bytes: int = 0
    handoff: HandoffFacts = field(default_factory=HandoffFacts)
    runner: dict | None = None
    role: str = "both"
    pool: PoolFacts = field(default_factory=PoolFacts)


@dataclass(frozen=True)
class Generation:
    """tokens [B, N] int64 (greedy; the first from the prefill); logits [B, N, V] float32, float64 in a float64 run (the row each
    token was chosen from); prompt_logits [T, V] (same dtype) or None; stats (:class:`~cpattn.engine.decode.SpecStats`);
    facts (:class:`RunFacts`, this rank's). Every rank returns the same tokens and logits."""

    tokens: torch.Tensor
    logits: torch.Tensor
    prompt_logits: torch.Tensor | None
    stats: SpecStats
    facts: RunFacts
