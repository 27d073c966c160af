"""Named cases op tests run, one frozen dataclass per kind (as FlashMLA's tests name their parameters).

:class:`AttnCase` (packed varlen attention) and :class:`PagedCase` (rows over a NaN-poisoned paged cache),
each with an ``id`` for pytest and a builder of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged import paged_cache


@dataclass(frozen=True)
class AttnCase:
    """Packed varlen attention: request i has ``q_lens[i]`` queries after ``k_lens[i] - q_lens[i]`` earlier keys."""

    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    hq: int
    hkv: int
    dqk: int
    dv: int
    causal: bool = True
    note: str = ""

    @property
    def id(self) -> str:
        return self.note or f"q{list(self.q_lens)}-k{list(self.k_lens)}-h{self.hq}/{self.hkv}-d{self.dqk}/{self.dv}"

    def cu(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cu_seqlens_q, cu_seqlens_k: [B+1] int32."""
        def cum(lens):
            return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)

        return cum(self.q_lens), cum(self.k_lens)

    def inputs(self, dtype: torch.dtype = torch.float32, seed: int = 0):
        """q [Tq, Hq, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv], and the oracle's q_req, k_req, q_pos, k_pos."""
        g = torch.Generator().manual_seed(seed)
        lq, lk = self.q_lens, self.k_lens
        q = torch.randn(sum(lq), self.hq, self.dqk, generator=g).to(dtype)
        k = torch.randn(sum(lk), self.hkv, self.dqk, generator=g).to(dtype)
        v = torch.randn(sum(lk), self.hkv, self.dv, generator=g).to(dtype)
        q_req = torch.cat([torch.full((n,), i) for i, n in enumerate(lq)])
        k_req = torch.cat([torch.full((n,), i) for i, n in enumerate(lk)])
        # bottom-right: query j of request i sits at position lk - lq + j
        q_pos = torch.cat([torch.arange(n) + lk[i] - n for i, n in enumerate(lq)])
        k_pos = torch.cat([torch.arange(n) for n in lk])
        return q, k, v, q_req, k_req, q_pos, k_pos


@dataclass(frozen=True)
class PagedCase:
    """Rows over a paged cache: request b holds ``kv_lens[b]`` keys; row i is (request, visible keys)."""

    kv_lens: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]
    block_size: int
    hq: int
    hkv: int
    dk: int
    dv: int
    note: str = ""

    @property
    def id(self) -> str:
        return self.note or f"kv{list(self.kv_lens)}-rows{len(self.rows)}-bs{self.block_size}-h{self.hq}/{self.hkv}"

    def args(self, dtype: torch.dtype = torch.float32, seed: int = 0):
        """(q [T, Hq, Dk], k_cache, v_cache (NaN-poisoned), block_table, req_indices [T], kv_lens [T] int32)."""
        gen = torch.Generator().manual_seed(seed)
        k_cache, v_cache, table = paged_cache(gen, list(self.kv_lens), self.block_size, self.hkv, self.dk, self.dv,
                                              dtype)
        q = torch.randn(len(self.rows), self.hq, self.dk, generator=gen).to(dtype)
        req = torch.tensor([r for r, _ in self.rows])
        lens = torch.tensor([n for _, n in self.rows], dtype=torch.int32)
        return q, k_cache, v_cache, table, req, lens
