"""One DeepSeek-V4 attention layer as partial attentions merged by LSE, and the sink rule.

A query at position p of a V4 layer attends (one K = V head of D = 512
dims, ``scale = D**-0.5``):

- the sliding window: tokens ``p - W + 1 .. p`` (W = 128);
- compressed entries (CSA / HCA layers): entry e (covering tokens below
  ``(e + 1) m``) once ``(e + 1) m <= p + 1``: all of them for HCA (m = 128),
  the indexer's top-k (512) of them for CSA (m = 4);
- a per-head sink: one more softmax logit ``sink[h]`` whose value is 0.

Each key set is a partial ``(out, lse)``; the layer is their LSE merge
(DESIGN.md §4.1). The keys split cleanly across devices, but the sink is
not a key: it must enter the merge of every (row, head) **exactly once**.

The rule: **the sink rides with the window partial.** Every (row, head) has
exactly one window partial in every layout, and only that partial carries
the sink (:func:`cpattn.ops.window_attention.window_attention_with_lse` with
``sinks``); every other partial -- compressed entries, another rank's
keys, a padding head -- is sink-free. So a merge of any number of
partials, in any order or grouping, counts the sink once:

- one device: {window + sink, entries};
- PCP: the rank that owns the query computes its window (own chunk plus
  a halo) with the sink; the entries come gathered: {window + sink, entries};
- DCP over N ranks: the window ring is replicated; rank r computes the
  window partial for its slice of heads only (with those heads' sinks) and
  ``(0, -inf)`` for the others; entries are sharded. Head h merges N entry
  partials and N window partials of which exactly one is live.

Worked example (one head, sink s = 0.5): the window keys give ``(o_w, l_w =
1.0)``, the entries ``(o_e, l_e = 2.0)`` on rank 0 and ``(o_e', -inf)`` on
rank 1 (it owns none yet). Rank 0 holds the head's window slice:
``l_w' = logaddexp(1.0, 0.5) = 1.474``, ``o_w' = o_w * exp(1.0 - 1.474)``.
Merging {(o_w', 1.474), (o_e, 2.0), (0, -inf), (o_e', -inf)} gives
``L = log(e^1 + e^0.5 + e^2) = 2.464``, ``O = (e^1 o_w + e^2 o_e) / e^L`` -- the
single-device softmax over {window, entries, sink}. Had both ranks added the
sink, L would be ``log(e^1 + 2 e^0.5 + e^2) = 2.596`` and every weight too small.

This module holds the layer's inputs (:class:`LayerInput`,
:class:`Compression`) and the partials shared by the one-device step
(:mod:`cpattn.v4.step`), PCP (:mod:`cpattn.v4.pcp`) and DCP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cpattn.ops.compressor import gated_pool
from cpattn.ops.dsa import indexer_scores, sparse_mla_attention_with_lse, topk_indices
from cpattn.ops.merge import merge_attn_states
from cpattn.ops.ref import acc_dtype


@dataclass(frozen=True)
class Compression:
    """One compressor's inputs for a step's T tokens.

    kv, gate: [T, C] -- the token's projections (``compressor.kv_proj`` /
    ``gate_proj``; C = 2D overlapping (CSA), D otherwise (HCA));
    position_bias: [m, C]; finish: ``(pooled [W, D], positions [W]) -> entries
    [W, D]`` -- the model's RMSNorm and RoPE of a pooled entry at its position
    ``e * m`` (the first token of its own window).
    """

    kv: torch.Tensor
    gate: torch.Tensor
    position_bias: torch.Tensor
    finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerInput:
    """Everything one V4 attention layer needs for a step's T tokens.

    q: [T, H, D] (RMSNorm'd, RoPE'd); kv: [T, D] (the K = V head, RoPE'd);
    sinks: [H]; scale: ``D**-0.5``. Compressed layers: compression (the
    entries' compressor). CSA layers also: index_q [T, H_I, D_I] (RoPE'd),
    index_weights [T, H_I] (every positive constant folded in),
    index_compression (the indexer's own compressor, producing keys of D_I),
    topk.
    """

    q: torch.Tensor
    kv: torch.Tensor
    sinks: torch.Tensor
    scale: float
    compression: Compression | None = None
    index_q: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None
    index_compression: Compression | None = None
    topk: int = 0


def compress(c: Compression, source: torch.Tensor, rows: torch.Tensor, prev_rows: torch.Tensor | None,
             positions: torch.Tensor) -> torch.Tensor:
    """Finished entries [W, D] of the windows whose slots are ``rows`` / ``prev_rows`` of ``source``.

    source: [S, 2C] rows ``[kv | gate]`` (a ring, or a halo plus a chunk);
    positions: [W] RoPE position of each entry (``e * m``).
    """
    width = source.shape[-1] // 2
    flat = source.reshape(-1, 2 * width)
    pooled = gated_pool(flat[:, :width], flat[:, width:], c.position_bias, rows, prev_rows)  # [W, D]
    return c.finish(pooled, positions)


def head_slice(out: torch.Tensor, lse: torch.Tensor, h0: int, h1: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A partial computed for heads ``h0:h1`` widened to all heads with ``(0, -inf)`` elsewhere."""
    if h0 == 0 and h1 == heads:
        return out, lse
    o = out.new_zeros(out.shape[0], heads, out.shape[2])
    l = lse.new_full((lse.shape[0], heads), float("-inf"))
    o[:, h0:h1], l[:, h0:h1] = out, lse
    return o, l


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE merge of partials [(out [T, H, D], lse [T, H])] in float32 (float64 if any is)."""
    if len(parts) == 1:
        return parts[0]
    wide = acc_dtype(*(o for o, _ in parts))
    return merge_attn_states(torch.stack([o.to(wide) for o, _ in parts]), torch.stack([l.to(wide) for _, l in parts]))


def csa_select(
    index_q: torch.Tensor, index_weights: torch.Tensor, keys: torch.Tensor, key_start: torch.Tensor,
    visible: torch.Tensor, topk: int, max_keys: int,
) -> torch.Tensor:
    """The indexer's top-k entries per row: [T, topk] request-local entry ids, -1 padded.

    keys: [S, D_I] every request's indexer keys, packed; row t's request
    starts at ``key_start[t]`` and row t sees its first ``visible[t]``
    (``(p + 1) // m``). Ties go to the earlier entry.
    """
    scores = indexer_scores(index_q, index_weights, keys, key_start, visible, max_keys)  # [T, max_keys]
    return topk_indices(scores, topk).long()


def sparse_partial(q: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor, scale: float):
    """Attention of q [T, H, D] over the entry rows ``slots`` [T, k] (-1 ignored) of a paged entry cache."""
    return sparse_mla_attention_with_lse(q, entries, slots, softmax_scale=scale, v_head_dim=q.shape[-1])
