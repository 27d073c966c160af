"""``CacheConfig``: the paged KV-cache layout (vLLM's ``CacheConfig`` plus the CP interleave).

A DCP rank owns token t iff ``(t // I) % dcp_size == rank`` with
``I = cp_kv_cache_interleave_size``; ``block_size % I == 0``. KV transfer
(P/D, pooling) under CP needs ``I == block_size`` so whole blocks move.

Example
-------
>>> CacheConfig(block_size=128, cp_kv_cache_interleave_size=128).whole_blocks
True
"""

from __future__ import annotations

from dataclasses import dataclass

from cpattn.config.problems import Checked, divisors, positive_ints, problem


@dataclass(frozen=True)
class CacheConfig(Checked):
    """block_size: tokens per KV block (default 128); cp_kv_cache_interleave_size: tokens per DCP owner run."""

    block_size: int = 128
    cp_kv_cache_interleave_size: int = 1

    @property
    def whole_blocks(self) -> bool:
        """True when every block belongs to one DCP rank (interleave == block size)."""
        return self.cp_kv_cache_interleave_size == self.block_size

    def field_problems(self) -> list[str]:
        return positive_ints(self, ("block_size", "cp_kv_cache_interleave_size"))

    def rule_problems(self) -> list[str]:
        out = []
        block, inter = self.block_size, self.cp_kv_cache_interleave_size
        if block % inter:
            out.append(problem("cp_kv_cache_interleave_size",
                               f"cp_kv_cache_interleave_size={inter}, block_size={block}",
                               "block_size % cp_kv_cache_interleave_size == 0",
                               f"use cp_kv_cache_interleave_size in {divisors(block)}"))
        return out
