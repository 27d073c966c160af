"""Several tensors as one message: their bytes side by side along the last dim (dtypes kept, exact bits).

>>> import torch
>>> s, i = torch.tensor([[1.5], [2.0]]), torch.tensor([[7], [9]])
>>> msg = pack_bytes([s, i])  # [2, 4 + 8] uint8
>>> [x.tolist() for x in unpack_bytes(msg, [s, i])]
[[[1.5], [2.0]], [[7], [9]]]
"""

from __future__ import annotations

import torch


def pack_bytes(xs: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors of equal leading shape ``[*]`` along a byte last dim: [*, sum of row bytes] uint8."""
    return torch.cat([x.contiguous().view(torch.uint8) for x in xs], dim=-1)


def unpack_bytes(msg: torch.Tensor, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_bytes`: split the byte last dim of ``msg`` [**, bytes] back into tensors
    [**, d_i] with the dtypes and last dims of ``likes`` (the leading dims may differ from theirs)."""
    outs, at = [], 0
    for x in likes:
        nb = x.shape[-1] * x.element_size()
        outs.append(msg[..., at : at + nb].contiguous().view(x.dtype))
        at += nb
    return outs
