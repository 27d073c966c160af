"""DeepSeek Sparse Attention across devices: DSA-CP and key-sharded exact top-k (DESIGN.md §4.4).

Modules: :mod:`~cpattn.dsa.single` (one device), :mod:`~cpattn.dsa.cp_plan`
and :mod:`~cpattn.dsa.cp` (DSA-CP), :mod:`~cpattn.dsa.dcp` (key-sharded).

Three entry points, all pure functions of tensors, a host-side plan and a
:class:`~cpattn.comm.Group`:

``dsa_attention`` -- one device: indexer -> top-k -> sparse MLA over a packed
varlen batch. The single-device meaning of everything below.

``dsa_cp_attention`` -- DSA-CP as in the guide. Tokens are split over the
group (``split="contiguous"``: the packed token dim cut into N ranges, as the
guide's DSA-CP / FlashComm does; ``split="balanced"``: the PCP head-tail
chunks of :func:`cpattn.layout.pcp.pcp_plan`). Each rank keeps all heads of
its tokens. The small per-token pieces ``[latent 512 | rope 64 | indexer
key]`` are all-gathered (one collective) and written into a replicated cache,
so the indexer sees every key and local top-k *is* the global top-k. The
output stays token-sharded or returns to the head-sharded layout with one
all-to-all::

    rank r: q, latent, k_I of its T_r tokens
        -- all_gather([latent | k_I]) --> replicated cache (+ cached context)
        -- indexer + top-k (exact) --> sparse MLA --> out [T_r, H, 512]
        -- all_to_all (output="head") --> out [T, H/N, 512]

Work per rank: the indexer of a token at position p scores p + 1 keys, its
sparse attention min(p + 1, k) keys; :func:`dsa_cp_work` reports both per
rank, for either split (contiguous ranges leave the last rank the longest
prefixes; head-tail pairs even them out). A layer without an indexer
(GLM-5's "shared" layers) reuses the selection a rank computed on an
earlier layer (``return_indices=True``): :func:`dsa_cp_sparse_attention`
gathers only its latents and attends the same cache rows.

``dsa_dcp_attention`` -- sparse attention over a key-sharded (DCP) cache:
rank r holds a subset of the keys, named by their global positions. Each
rank scores its own keys and keeps its local top-k candidates
``(score, global id)``; the candidates are all-gathered and the global top-k
re-selected with the same strict order (score descending, id ascending).
This is exact: an element of the global top-k has fewer than k elements
ahead of it globally, hence fewer than k ahead of it on its owner, so it is
among its owner's candidates. The union of the local top-k sets is NOT the
global top-k (it holds up to N*k keys); attending that union would change
the result. Each rank then attends the selected keys it owns and the
partials are merged by LSE (:func:`cpattn.ops.merge_attn_states`).

The softmax scale is always the model's (``qk_head_dim**-0.5 * mscale**2``,
:func:`cpattn.ops.dsa.mla_softmax_scale`), never ``576**-0.5``.
"""

from cpattn.dsa.cp import OUTPUTS_CP, DSACache, dsa_cp_attention, dsa_cp_sparse_attention
from cpattn.dsa.cp_plan import SPLITS, DSACPPlan, dsa_cp_plan, dsa_cp_work
from cpattn.dsa.dcp import (
    OUTPUTS_DCP, ShardedKeys, dcp_shard_keys, dsa_dcp_attention, dsa_dcp_topk, exchange_topk, global_topk,
    select_topk_candidates,
)
from cpattn.dsa.single import dsa_attention

__all__ = [
    "dsa_attention", "DSACPPlan", "dsa_cp_plan", "dsa_cp_work", "DSACache",
    "dsa_cp_attention", "dsa_cp_sparse_attention", "ShardedKeys", "dcp_shard_keys", "select_topk_candidates",
    "exchange_topk", "global_topk", "dsa_dcp_topk", "dsa_dcp_attention", "SPLITS", "OUTPUTS_CP", "OUTPUTS_DCP",
]
