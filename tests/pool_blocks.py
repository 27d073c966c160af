"""Payloads for the pool tests: seeded random blocks of an identity's shape, compared bit for bit."""

import torch


def random_blocks(ident, n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` seeded payloads [L, block_size, F] in ``ident.dtype``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ident.block_shape, generator=g).to(ident.dtype) for _ in range(n)]


def same_blocks(a, b) -> bool:
    """Two lists of 16-bit payloads equal bit for bit (NaN payloads included)."""
    return len(a) == len(b) and all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))
