"""``gated_pool``: DeepSeek-V4's KV compressors (softmax-gated pooling of token windows).

A compressor turns every ``m`` source tokens into one compressed KV entry.
Each token t has a projected value ``kv[t]`` and gate ``gate[t]`` (both
``[C]``); slot j of a window adds a learned ``position_bias[j]``. Per channel,
the entry is the softmax-weighted sum of its slots::

    entry[d] = sum_slot softmax_slot(gate[slot, d] + bias[slot, d]) * kv[slot, d]

Two shapes of window (``m`` = ratio):

- non-overlapping (HCA, m = 128): entry w pools tokens ``w*m .. w*m+m-1``,
  all ``C = D`` channels.
- overlapping (CSA, m = 4): ``C = 2D``; each token carries two series,
  ``Ca = [:D]`` and ``Cb = [D:]``. Entry w pools 2m slots: Ca of the previous
  window's tokens (``(w-1)*m ..``) and Cb of its own (``w*m ..``) -- width 2m,
  stride m. Entry 0 has no previous window: those slots are empty::

      tokens    0 1 2 3 | 4 5 6 7 | 8 9 10 11
      entry 0      Cb   |         |
      entry 1      Ca   |    Cb   |
      entry 2           |    Ca   |    Cb

The op reads tokens through row indices, so the source may be a packed
batch, a paged ring buffer or a PCP halo: ``rows[w, j]`` is the row of ``kv``
/ ``gate`` holding slot j of window w (the Cb slots when overlapping) and
``prev_rows[w, j]`` the Ca slots; ``-1`` is an empty slot (weight 0, never
read, so poisoned rows stay out). The softmax runs in float32 (float64 for
float64 inputs); a channel whose slots are all empty gives 0. RMSNorm and
RoPE of the entry are the model's, applied after this op.
"""

from __future__ import annotations

import torch

from cpattn.ops import checks, registry
from cpattn.ops.ref import acc_dtype


def _slots(x: torch.Tensor, rows: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """x[rows, lo:hi] with -1 rows read as row 0 (masked by the caller): [W, m, hi-lo]."""
    return x[rows.clamp(min=0).long()][..., lo:hi]


def pool(
    kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, rows: torch.Tensor,
    prev_rows: torch.Tensor | None,
) -> torch.Tensor:
    """The op's math in plain torch (no host sync, static shapes): see the module doc."""
    acc = acc_dtype(kv.dtype)
    c = kv.shape[1]
    d = c // 2 if prev_rows is not None else c
    bias = position_bias.to(acc)  # [m, C]
    vals = [_slots(kv, rows, c - d, c).to(acc)]  # [W, m, D]: the window's own slots (Cb when overlapping)
    gates = [_slots(gate, rows, c - d, c).to(acc) + bias[:, c - d:]]
    live = [rows >= 0]  # [W, m]
    if prev_rows is not None:
        vals.insert(0, _slots(kv, prev_rows, 0, d).to(acc))  # Ca of the previous window
        gates.insert(0, _slots(gate, prev_rows, 0, d).to(acc) + bias[:, :d])
        live.insert(0, prev_rows >= 0)
    v = torch.cat(vals, dim=1)  # [W, S, D]
    g = torch.cat(gates, dim=1)  # [W, S, D]
    on = torch.cat(live, dim=1)[..., None]  # [W, S, 1]
    v = torch.where(on, v, 0.0)  # empty slots may hold NaN: never let it in
    g = torch.where(on, g, float("-inf"))
    top = g.amax(dim=1, keepdim=True)  # [W, 1, D]
    top = torch.where(top == float("-inf"), 0.0, top)  # all-empty channel: weights 0 (NaN data still propagates)
    e = torch.exp(g - top)  # [W, S, D]
    den = e.sum(dim=1)  # [W, D]
    out = (e * v).sum(dim=1) / torch.where(den > 0, den, 1.0)
    return out.to(kv.dtype)


@registry.define("gated_pool")
def _gated_pool_op(
    kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, rows: torch.Tensor,
    prev_rows: torch.Tensor | None,
) -> torch.Tensor:
    return pool(kv, gate, position_bias, rows, prev_rows)


registry.generic("gated_pool")  # plain torch: one body serves every device and is the CPU decomposition


@registry.fake("gated_pool")
def _gated_pool_fake(kv, gate, position_bias, rows, prev_rows):
    d = kv.shape[1] // 2 if prev_rows is not None else kv.shape[1]
    return kv.new_empty(rows.shape[0], d)


def gated_pool(
    kv: torch.Tensor,
    gate: torch.Tensor,
    position_bias: torch.Tensor,
    rows: torch.Tensor,
    prev_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compress windows of tokens into one entry each (DeepSeek-V4's CSA / HCA compressors).

    Arguments
    ---------
    kv, gate: [S, C] -- projected values and gates of the source tokens (any
        rows; a packed batch, a ring buffer, a halo).
    position_bias: [m, C] -- added to the gate of window slot j.
    rows: [W, m] int -- row of slot j of window w (its own tokens); -1 empty.
    prev_rows: [W, m] int or None -- overlapping windows (CSA, ``C = 2D``):
        rows of the previous window's tokens, whose first D channels join
        the pool; -1 empty (entry 0). None: non-overlapping (HCA, ``C = D``).

    Returns
    -------
    entries: [W, D] in kv's dtype (softmax in float32, float64 for float64).

    Example
    -------
    >>> import torch
    >>> from cpattn.ops.compressor import gated_pool
    >>> kv, gate = torch.arange(8.0)[:, None].repeat(1, 2), torch.zeros(8, 2)
    >>> gated_pool(kv, gate, torch.zeros(4, 2), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])).tolist()
    [[1.5, 1.5], [5.5, 5.5]]
    >>> prev = torch.tensor([[-1, -1, -1, -1], [0, 1, 2, 3]])  # overlapping: entry 1 also pools tokens 0..3
    >>> gated_pool(kv, gate, torch.zeros(4, 2), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), prev).tolist()
    [[1.5], [3.5]]
    """
    for name, x in (("kv", kv), ("gate", gate)):
        if x.dim() != 2 or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating [S, C] tensor; got {x.dtype} {tuple(x.shape)}")
    checks.same_device("kv", kv, gate=gate, position_bias=position_bias, rows=rows, prev_rows=prev_rows)
    if gate.shape != kv.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must match kv {tuple(kv.shape)}")
    if rows.dim() != 2 or rows.is_floating_point():
        raise ValueError(f"rows must be an int [W, m] tensor; got {rows.dtype} {tuple(rows.shape)}")
    if position_bias.shape != (rows.shape[1], kv.shape[1]):
        raise ValueError(
            f"position_bias must be [m={rows.shape[1]}, C={kv.shape[1]}] (one bias row per window slot); "
            f"got {tuple(position_bias.shape)}"
        )
    if prev_rows is not None:
        if prev_rows.shape != rows.shape or prev_rows.is_floating_point():
            raise ValueError(
                f"prev_rows must be an int [W, m] like rows {tuple(rows.shape)}; got {prev_rows.dtype} "
                f"{tuple(prev_rows.shape)}"
            )
        if kv.shape[1] % 2:
            raise ValueError(f"overlapping windows need C = 2D channels (Ca | Cb); got C = {kv.shape[1]}")
    return registry.call("gated_pool", kv, gate, position_bias, rows, prev_rows)
