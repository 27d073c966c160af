"""The cache-backend seam: what the engine asks of a KV kind, declared by a family by name.

A family declares its cache kind (``ModelFamily(..., cache="paged" | "v4" | "hybrid")``),
as a vLLM layer declares its KV cache spec; the driver looks the backend up
(:func:`backend_for`, or ``family.backend``) and calls it, never asking which
kind it is. Three kinds:

- ``"paged"`` (:class:`cpattn.engine.backends.paged.PagedBackend`): per-token
  KV rows (:class:`~cpattn.models.family.KVLayout`) in a DCP-sharded paged
  cache (:class:`~cpattn.engine.paged_cache.PagedShard`), PCP / DSA-CP
  prefill, rows or whole blocks handed off;
- ``"v4"`` (:class:`cpattn.engine.backends.v4.V4Backend`): DeepSeek-V4's
  rings and compressed entries (:class:`~cpattn.v4.engine.V4Stages`);
- ``"hybrid"`` (:class:`cpattn.engine.backends.hybrid.HybridBackend`): paged
  KV for a hybrid model's full-attention layers plus a per-request recurrent
  state for its linear-attention layers (Qwen3-Next), replicated on every DCP rank.

What moves between ranks goes through a :class:`~cpattn.comm.group.Group`
(collectives inside a stage group, ``send`` / ``recv`` across P/D).

Example
-------
>>> from cpattn.models.family import get_family
>>> backend_for(get_family("qwen3")).name, backend_for(get_family("deepseek_v4")).name
('paged', 'v4')
>>> backend_for(get_family("deepseek_v4")).per_token_kv
False
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from cpattn.comm.group import Group
from cpattn.models.family import CACHE_KINDS, register_backends
from cpattn.dcp.layer_merges import ENGINE_MERGE



@runtime_checkable
class DecodeProgram(Protocol):
    """A decode step over one rank's cache, as the loop and a :class:`~cpattn.graphs.DecodeRunner` drive it:
    ``step(state, batch)``, ``state``, ``fields``, ``device``; ``batch(requests, context_lens, tokens)`` plans
    a step of ``tokens`` [A * q] after ``context_lens`` cached tokens of ``requests``; ``commit(requests,
    seq_lens)`` keeps ``seq_lens[i]`` tokens of ``requests[i]`` after the step (the rest is rolled back)."""

    step: Any
    state: dict
    fields: dict
    device: Any

    def batch(self, requests: list[int], context_lens: list[int], tokens: torch.Tensor) -> dict: ...

    def commit(self, requests: list[int], seq_lens: list[int]) -> None: ...


@runtime_checkable
class CacheBackend(Protocol):
    """One KV kind's stages (every method runs on every rank of the group it names).

    - ``prefill(group, family, params, cfg, prompts, *, algorithms, prompt_logits, prefix, hidden_layers)``:
      the prefill over ``group``; an output with ``first_logits`` [B, V], ``prompt_logits``, ``hidden``.
    - ``new_cache(family, cfg, params, prompts, steps, decode_cfg, num_speculative_tokens, group)``: this
      decode rank's empty cache (a ``kv_bytes()``), room for the prompts, ``steps`` tokens and k drafts.
    - ``collect(prefill_group, out)``: what the decode caches need, the same on every prefill rank (the
      simulated run hands it over in memory); ``place(cache, collected, decode_group)`` seeds a cache.
    - ``handoff(world, prefill_group, decode_group, cache, out, algorithms, prefix)``: engines on the same
      ranks, both steps; a :class:`~cpattn.engine.handoff.HandoffFacts`.
    - ``send(world, prefill_group, out, decode_ranks, block_size)`` / ``recv(world, cache, prompts, cfg, *,
      prefill_ranks, decode_group, dtype)``: P/D on separate ranks of ``world`` (point to point); recv
      seeds the cache and returns (first-token logits [B, V], facts).
    - ``program(group, family, params, cfg, cache, *, merge, hidden_layers)``: a :class:`DecodeProgram`.
    - ``per_token_kv``: the cache is per-token rows, so a cached prefix, a KV pool and whole-sequence
      attention (drafter training) apply.
    """

    name: str
    per_token_kv: bool

    def prefill(self, group: Group, family, params: dict, cfg: Any, prompts, *, algorithms, prompt_logits: bool,
                prefix, hidden_layers): ...

    def new_cache(self, family, cfg: Any, params: dict, prompts, steps: int, decode_cfg, num_speculative_tokens: int,
                  group: Group): ...

    def collect(self, prefill_group: Group, out) -> Any: ...

    def place(self, cache, collected, decode_group: Group) -> None: ...

    def handoff(self, world: Group, prefill_group: Group, decode_group: Group, cache, out, algorithms,
                prefix=None): ...

    def send(self, world: Group, prefill_group: Group, out, decode_ranks: list[int], block_size: int): ...

    def recv(self, world: Group, cache, prompts, cfg: Any, *, prefill_ranks: list[int], decode_group: Group,
             dtype: torch.dtype): ...

    def program(self, group: Group, family, params: dict, cfg: Any, cache, *, merge: str = ENGINE_MERGE,
                hidden_layers: tuple | None = None) -> DecodeProgram: ...


def backend_for(family) -> CacheBackend:
    """The backend of a family's declared cache kind (``family.cache``); a legacy ``stages`` object (the
    deprecated way to declare DeepSeek-V4's kind) is served by the V4 backend over those stages."""
    kind = family.cache
    if kind == "paged":
        from cpattn.engine.backends.paged import PAGED

        return PAGED
    if kind == "v4":
        from cpattn.engine.backends.v4 import V4Backend

        return V4Backend.of(family)
    if kind == "hybrid":
        from cpattn.engine.backends.hybrid import HYBRID

        return HYBRID
    raise ValueError(f"family {family.name!r}: cache={kind!r} is not a cache kind; expected one of {CACHE_KINDS}")


register_backends(backend_for)  # ModelFamily.backend looks kinds up here without importing the engine
