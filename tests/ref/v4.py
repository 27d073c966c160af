"""Plain float64 references for the DeepSeek-V4 attention ops (formerly ``cpattn.ops.v4_ref``).

Slow and obvious: loops over windows and query rows, an explicit list of the
keys each row sees, a softmax over all of them. Nothing in the library uses
them; tests compare the ops and the whole V4 attention against these.

- :func:`gated_pool_ref` -- one compressed entry per window: a per-channel
  softmax over the window's slots of ``gate + position_bias``, weighting
  the slots' ``kv`` (overlapping CSA windows take the previous window's
  first half of the channels).
- :func:`window_attention_ref` -- each row attends the positions
  ``[kv_starts, kv_ends)`` of its request's ring (slot = position % ring),
  plus an optional per-head sink in the softmax denominator.
- :func:`v4_attention_ref` -- one V4 layer's attention over whole sequences,
  as the Hugging Face model computes it: sliding window of ``window``
  tokens, compressed entries concatenated onto the keys (all visible ones
  for HCA, the indexer's top-k for CSA), a per-head sink.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .topk import topk_order

F64 = torch.float64


def gated_pool_ref(
    kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, rows: torch.Tensor,
    prev_rows: torch.Tensor | None,
) -> torch.Tensor:
    """Gated pooling, one window at a time, in float64.

    kv, gate: [S, C]; position_bias: [m, C]; rows: [W, m] (-1: empty slot);
    prev_rows: [W, m] or None. Without prev_rows, entry w pools slots
    ``rows[w, j]`` over all C channels. With prev_rows (C = 2D), entry w pools
    2m slots: ``prev_rows[w, j]`` with channels ``[:D]`` and ``rows[w, j]`` with
    channels ``[D:]``. Returns [W, D] float64 (0 where a window has no slot).
    """
    w_n, m = rows.shape
    c = kv.shape[1]
    d = c // 2 if prev_rows is not None else c
    out = torch.zeros(w_n, d, dtype=F64)
    for w in range(w_n):
        slots_kv, slots_g = [], []
        for j in range(m):
            if prev_rows is not None and int(prev_rows[w, j]) >= 0:
                r = int(prev_rows[w, j])
                slots_kv.append(kv[r, :d].double())
                slots_g.append(gate[r, :d].double() + position_bias[j, :d].double())
        for j in range(m):
            if int(rows[w, j]) >= 0:
                r = int(rows[w, j])
                slots_kv.append(kv[r, c - d:].double())
                slots_g.append(gate[r, c - d:].double() + position_bias[j, c - d:].double())
        if slots_kv:
            weights = torch.softmax(torch.stack(slots_g), dim=0)  # [slots, D]
            out[w] = (weights * torch.stack(slots_kv)).sum(0)
    return out


def window_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    req_indices: torch.Tensor, kv_starts: torch.Tensor, kv_ends: torch.Tensor, softmax_scale: float,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window paged attention, row by row, in float64.

    q: [T, Hq, Dk]; k_cache/v_cache: [NB, BS, Hkv, D*]; block_table: [B, n];
    row t of request ``req_indices[t]`` (< 0: padding, gets (0, -inf)) sees
    positions ``max(0, kv_starts[t]) .. kv_ends[t] - 1``; position p lives in
    ring slot ``p % (n * BS)``. ``sinks`` [Hq]: an extra logit per head with
    value 0. Returns out [T, Hq, Dv], lse [T, Hq] (float64).
    """
    t_n, hq, _ = q.shape
    _, bs, hkv, dv = v_cache.shape
    ring = block_table.shape[1] * bs
    out = torch.zeros(t_n, hq, dv, dtype=F64)
    lse = torch.full((t_n, hq), float("-inf"), dtype=F64)
    for t in range(t_n):
        b = int(req_indices[t])
        if b < 0:
            continue
        keys, vals = [], []
        for p in range(max(0, int(kv_starts[t])), int(kv_ends[t])):
            s = p % ring
            blk = int(block_table[b, s // bs])
            keys.append(k_cache[blk, s % bs].double())  # [Hkv, Dk]
            vals.append(v_cache[blk, s % bs].double())
        for h in range(hq):
            kvh = h // (hq // hkv)
            logits = [float(q[t, h].double() @ k[kvh]) * softmax_scale for k in keys]
            if sinks is not None:
                logits.append(float(sinks[h]))
            if not logits:
                continue
            lg = torch.tensor(logits, dtype=F64)
            lse[t, h] = torch.logsumexp(lg, 0)
            p = torch.softmax(lg, 0)[: len(vals)]
            if vals:
                out[t, h] = (p[:, None] * torch.stack([v[kvh] for v in vals])).sum(0)
    return out, lse


def v4_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int,
    entries: torch.Tensor | None = None,
    ratio: int = 0,
    selected: Callable[[int, int], list[int]] | None = None,
) -> torch.Tensor:
    """One request's V4 attention over a whole sequence, in float64 (the Hugging Face semantics).

    q: [L, H, D] queries at positions 0..L-1; kv: [L, D] the single K = V
    head; sinks: [H]; window: query p sees tokens ``p - window + 1 .. p``.
    entries: [E, D] compressed entries (entry e covers tokens ``< (e+1) * ratio``
    and is visible to query p iff ``(e + 1) * ratio <= p + 1``); ``selected(p,
    n_visible)`` returns the visible entries query p attends (CSA: the
    indexer's top-k; default: all of them, HCA). Returns out [L, H, D].
    """
    length, h_n, _ = q.shape
    out = torch.zeros(length, h_n, kv.shape[1], dtype=F64)
    for p in range(length):
        keys = [kv[j].double() for j in range(max(0, p - window + 1), p + 1)]
        if entries is not None and ratio:
            n_vis = (p + 1) // ratio
            chosen = list(range(n_vis)) if selected is None else selected(p, n_vis)
            keys += [entries[e].double() for e in chosen]
        k = torch.stack(keys)  # [K, D]
        logits = (q[p].double() @ k.T) * scale  # [H, K]
        logits = torch.cat([logits, sinks.double()[:, None]], dim=1)  # the sink: one more logit, value 0
        probs = torch.softmax(logits, dim=1)[:, :-1]
        out[p] = probs @ k
    return out


def indexer_topk_ref(
    q_index: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, topk: int
) -> Callable[[int, int], list[int]]:
    """CSA selection for one request: ``selected(p, n_visible)`` for :func:`v4_attention_ref`.

    q_index: [L, H_I, D_I]; weights: [L, H_I] (every positive constant folded
    in); index_keys: [E, D_I]. Score ``I[p, e] = sum_h w[p,h] relu(q[p,h] . k[e])``
    over the visible entries; keep the ``topk`` best (score descending, entry
    ascending on ties).
    """

    def selected(p: int, n_vis: int) -> list[int]:
        if n_vis == 0:
            return []
        s = torch.relu(q_index[p].double() @ index_keys[:n_vis].double().T)  # [H_I, E]
        score = (weights[p].double()[:, None] * s).sum(0)  # [E]
        return topk_order(score.tolist(), topk)

    return selected
