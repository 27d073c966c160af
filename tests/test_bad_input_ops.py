"""Every bad argument of every public op and primitive is a ValueError that names it (one table).

Each row: the call, the exact exception type, and a fragment of the message
that names the argument and shows the offending value. Primitives that take
a group run on a one-rank simulated group: the checks come before any
collective, so the error is the caller's own ValueError.
"""

import re

import pytest
import torch

from cpattn import ops
from cpattn.comm.sim import SimMesh
from cpattn.dcp import DCPContext, dcp_decode, dcp_plan
from cpattn.dsa import (
    ShardedKeys, dcp_shard_keys, dsa_attention, dsa_cp_plan, dsa_dcp_attention, dsa_dcp_topk,
)
from cpattn.layout.dcp import dcp_local_lens, dcp_owner, dcp_slot_mapping, reshard_kv_blocks
from cpattn.layout.pcp import pcp_plan, pcp_shard, pcp_unshard
from cpattn.ops.dsa import causal_key_ranges, selection_mismatch
from cpattn.ops.merge import merge_into
from cpattn.pcp import Context, pcp_prefill

T = torch.tensor


def one():
    return SimMesh(1).groups()[0]


def att(cu_q=(0, 4), cu_k=(0, 4), t=4):
    x = torch.randn(t, 2, 8)
    cq = cu_q if isinstance(cu_q, torch.Tensor) else T(cu_q)
    ck = cu_k if isinstance(cu_k, torch.Tensor) else T(cu_k)
    return lambda: ops.attention_with_lse(x, x, x, cq, ck, causal=True)


def paged(table=((0, 1),), req=(0, 0), lens=(3, 6), nb=3):
    kc = torch.randn(nb, 4, 2, 8)
    return lambda: ops.paged_attention_with_lse(torch.randn(len(req), 4, 8), kc, kc, T(table), T(req), T(lens))


def wkv(slots):
    kc = torch.zeros(3, 4, 1, 8)  # 12 slots
    return lambda: ops.write_kv(kc, kc.clone(), torch.ones(len(slots), 1, 8), torch.ones(len(slots), 1, 8), slots)


def indexer(start=(0, 0), vis=(1, 2), max_keys=None):
    q, w, k = torch.randn(2, 3, 8), torch.rand(2, 3), torch.randn(5, 8)
    s = start if isinstance(start, torch.Tensor) else T(start)
    return lambda: ops.indexer_scores(q, w, k, s, T(vis), max_keys)


def sparse(idx):
    q, cache = torch.randn(2, 4, 24), torch.randn(10, 24)
    return lambda: ops.sparse_mla_attention_with_lse(q, cache, idx, softmax_scale=0.1, v_head_dim=16)


META = torch.device("meta")  # "another device" that every machine has


def mlapo(slots, **move):
    """mla_preprocess of 3 tokens (T=3, H=16, Hq=2, nope=8, rope=4, r=12, Rq=10); ``move`` puts arguments on meta."""
    g = torch.Generator().manual_seed(0)
    w = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    args = dict(hidden=w(3, 16), kv_cache=torch.zeros(2, 4, 1, 16), slot_mapping=slots,
                cos=torch.ones(3, 2), sin=torch.zeros(3, 2), input_norm_weight=torch.ones(16), q_a_weight=w(10, 16),
                q_a_norm_weight=torch.ones(10), q_b_weight=w(24, 10), kv_a_weight=w(16, 16),
                kv_a_norm_weight=torch.ones(12), w_uk=w(2, 8, 12))
    args.update((k, args[k].to(META)) for k in move)
    return lambda: ops.mla_preprocess(**args, eps=1e-6, rope_interleave=True)


def window(**move):
    """window_attention_with_lse of 2 rows over one ring of 8 slots; ``move`` puts arguments on meta."""
    ring, pos = torch.randn(2, 4, 1, 8), T([9, 10])
    args = dict(q=torch.randn(2, 2, 8), k_cache=ring, v_cache=ring, block_table=T([[1, 0]]), req_indices=T([0, 0]),
                kv_starts=pos - 3, kv_ends=pos + 1, sinks=torch.zeros(2))
    args.update((k, args[k].to(META)) for k in move)
    return lambda: ops.window_attention_with_lse(**args)


def paged_on(**move):
    """The valid paged call of :func:`paged`, with the arguments ``move`` names on meta."""
    kc = torch.randn(3, 4, 2, 8)
    args = dict(q=torch.randn(2, 4, 8), k_cache=kc, v_cache=kc, block_table=T([[0, 1]]), req_indices=T([0, 0]),
                kv_lens=T([3, 6]))
    args.update((k, args[k].to(META)) for k in move)
    return lambda: ops.paged_attention_with_lse(**args)


def prefill(context=None, plan=None):
    q = torch.randn(4, 2, 8)
    p = plan if plan is not None else pcp_plan([0, 4], 1)
    return lambda: pcp_prefill(q, q, q, p, group=one(), context=context)


def dcp_ctx(ctx_lens=(3,), table=((0,),), cu=(0, 2)):
    kc = torch.randn(2, 4, 1, 8)
    c = DCPContext(kc, kc, T(table), T(ctx_lens), interleave_size=1)
    return lambda: c.attend(torch.randn(2, 2, 8), T(cu), 0.3, one())


def topk_args(positions=(0, 1, 2), cu_q=(0, 3), ids=None):
    lat, ki = torch.randn(3, 24), torch.randn(3, 8)
    keys = dcp_shard_keys(lat, ki, [0, 3], 0, 1)
    if ids is not None:
        keys = ShardedKeys(keys.latent, keys.k_index, T(ids), keys.cu_seqlens)
    q_i, w_i = torch.randn(3, 2, 8), torch.rand(3, 2)
    return lambda: dsa_dcp_topk(q_i, w_i, T(positions), list(cu_q), keys, group=one(), topk=2)


def dsa_one(cu_q=(0, 3), cu_k=(0, 3)):
    x = [torch.randn(3, 4, 24), torch.randn(3, 24), torch.randn(3, 2, 8), torch.rand(3, 2), torch.randn(3, 8)]
    return lambda: dsa_attention(*x, list(cu_q), list(cu_k), topk=2, softmax_scale=0.1, v_head_dim=16)


ROWS = [
    # attention_with_lse
    ("attn non-monotone cu", att((0, 5, 2), (0, 5, 2), t=2),
     "cu_seqlens_q must be non-decreasing (request b holds tokens cu_seqlens_q[b]:cu_seqlens_q[b+1]); got "
     "cu_seqlens_q[1] = 5 > cu_seqlens_q[2] = 2"),
    ("attn cu past q", att((0, 9)), "cu_seqlens_q ends at 9 but q has 4 tokens; its last entry must be at most 4"),
    ("attn cu past k", att((0, 4), (0, 7)), "cu_seqlens_k ends at 7 but k has 4 tokens"),
    ("attn negative cu", att((-1, 4), (0, 4)), "cu_seqlens_q[0] = -1; token offsets must be >= 0"),
    ("attn float cu", att(T([0.0, 4.0])), "cu_seqlens_q must be int32 or int64; got torch.float32"),
    ("attn 2-D cu", att(T([[0, 4]])), "cu_seqlens_q must be 1-D [B+1]"),
    ("attn B differs", att((0, 4), (0, 2, 4)), "same B requests"),
    # paged_attention_with_lse
    ("paged block past cache", paged(table=((0, 9),)), "block_table[0, 1] = 9 is read by query row 1"),
    ("paged -1 block read", paged(table=((0, -1),)),
     "block_table[0, 1] = -1 is read by query row 1 (kv_lens[1] = 6 keys need 2 blocks): a -1 block inside"),
    ("paged request past table", paged(req=(0, 1)), "req_indices[1] = 1; expected a row of block_table (0..0)"),
    ("paged negative kv_len", paged(lens=(-1, 6)), "kv_lens[0] = -1; expected a key count >= 0"),
    ("paged kv_len past table", paged(lens=(3, 9)), "kv_lens[1] = 9 keys, but a block_table row addresses only 2"),
    ("paged float kv_lens", paged(lens=(3.0, 6.0)), "kv_lens must be an integer tensor [T=2]"),
    ("paged bool req", lambda: ops.paged_attention_with_lse(torch.randn(1, 4, 8), torch.randn(1, 4, 2, 8),
                                                            torch.randn(1, 4, 2, 8), T([[0]]), T([True]), T([1])),
     "req_indices must be an integer tensor"),
    # write_kv / write_kv_mla
    ("write_kv slot past cache", wkv(T([3, 40])), "slot_mapping[1] = 40; expected -1 (skip the token) or a slot in "
                                                   "0..11 (k_cache has 3 blocks x 4)"),
    ("write_kv slot -2", wkv(T([-2, 0])), "slot_mapping[0] = -2"),
    ("write_kv float slots", wkv(T([0.0, 1.0])), "slot_mapping must be int32/int64"),
    ("write_kv_mla slot past cache",
     lambda: ops.write_kv_mla(torch.zeros(2, 4, 1, 24), torch.ones(1, 16), torch.ones(1, 8), T([8])),
     "slot_mapping[0] = 8; expected -1 (skip the token) or a slot in 0..7 (kv_cache has 2 blocks x 4)"),
    # two tokens to one slot: one token's KV would be lost (-1 may repeat: see the valid calls below)
    ("write_kv repeated slot", wkv(T([3, -1, 7, -1, 3])),
     "slot_mapping[4] = 3 repeats slot_mapping[0]; expected distinct slots, one per written token (-1 may repeat): "
     "two tokens in one slot lose one token's KV. Give each token its own slot, or -1 to skip it"),
    ("write_kv_mla repeated slot",
     lambda: ops.write_kv_mla(torch.zeros(2, 4, 1, 24), torch.ones(3, 16), torch.ones(3, 8), T([6, 2, 6])),
     "slot_mapping[2] = 6 repeats slot_mapping[0]; expected distinct slots"),
    ("write_rows repeated slot", lambda: ops.write_rows(torch.zeros(2, 2, 3), torch.ones(3, 3), T([1, -1, 1])),
     "slots[2] = 1 repeats slots[0]; expected distinct slots, one per written token (-1 may repeat): two tokens in "
     "one slot lose one token's row"),
    ("write_rows slot past cache", lambda: ops.write_rows(torch.zeros(2, 2, 3), torch.ones(1, 3), T([4])),
     "slots[0] = 4; expected -1 (skip the token) or a slot in 0..3 (cache has 2 blocks x 2)"),
    ("mla_preprocess repeated slot", mlapo(T([5, -1, 5])), "slot_mapping[2] = 5 repeats slot_mapping[0]"),
    ("mla_preprocess slot past cache", mlapo(T([5, 8, -1])),
     "slot_mapping[1] = 8; expected -1 (skip the token) or a slot in 0..7 (kv_cache has 2 blocks x 4)"),
    ("mla_preprocess slot -2", mlapo(T([-2, 0, 1])), "slot_mapping[0] = -2"),
    # indexer_scores / topk_indices / sparse MLA / causal_key_ranges
    ("indexer range past k", indexer(start=(0, 4), vis=(1, 2)),
     "query 1: key_start[1] = 4, visible[1] = 2; expected 0 <= key_start"),
    ("indexer negative visible", indexer(vis=(-1, 2)), "visible[0] = -1"),
    ("indexer visible past max_keys", indexer(vis=(1, 3), max_keys=2), "visible <= max_keys = 2"),
    ("indexer negative key_start", indexer(start=(-1, 0)), "key_start[0] = -1"),
    ("indexer float key_start", indexer(start=T([0.0, 0.0])), "key_start must be an integer tensor [T=2]"),
    ("indexer float max_keys", indexer(max_keys=2.5), "max_keys must be an integer; got 2.5"),
    ("topk k=0", lambda: ops.topk_indices(torch.randn(2, 3), 0), "k must be >= 1; got 0"),
    ("topk float k", lambda: ops.topk_indices(torch.randn(2, 3), 1.5), "k must be an integer; got 1.5"),
    ("sparse index past cache", sparse(T([[0, 10], [1, -1]])),
     "indices[0, 1] = 10; expected -1 (no key) or a row of latent_cache in 0..9 (10 rows)"),
    ("sparse index -2", sparse(T([[0, 1], [-2, -1]])), "indices[1, 0] = -2"),
    ("sparse float indices", sparse(T([[0.0], [1.0]])), "indices must be an integer tensor [T=2, K]"),
    ("sparse repeated index", sparse(T([[0, 5, -1, -1], [3, 9, -1, 3]])),
     "indices[1, 3] = 3 repeats indices[1, 0]; expected distinct cache rows in each query's row (-1 may repeat): "
     "a repeated row counts its key twice. Pad a short selection with -1"),
    ("key ranges float", lambda: causal_key_ranges([0, 2.5], [0, 3]),
     "cu_seqlens_q must hold integers (token counts); got 2.5 (float) at index 1"),
    ("key ranges decreasing", lambda: causal_key_ranges([0, 3], [0, 3, 1]), "cu_seqlens_k must be non-decreasing"),
    # tensors on different devices (meta stands for any other device: no accelerator needed)
    ("attn q on meta", lambda: ops.attention_with_lse(torch.randn(4, 2, 8, device=META), torch.randn(4, 2, 8),
                                                      torch.randn(4, 2, 8), T([0, 4]), T([0, 4])),
     "k is on cpu but q is on meta; pass every tensor argument on one device (k.to(q.device))"),
    ("attn cu_seqlens on meta", lambda: ops.attention_with_lse(torch.randn(4, 2, 8), torch.randn(4, 2, 8),
                                                               torch.randn(4, 2, 8), T([0, 4]), T([0, 4]).to(META)),
     "cu_seqlens_k is on meta but q is on cpu"),
    ("paged q on meta", paged_on(q=1), "k_cache is on cpu but q is on meta"),
    ("paged table on meta", paged_on(block_table=1), "block_table is on meta but q is on cpu"),
    ("paged kv_lens on meta", paged_on(kv_lens=1), "kv_lens is on meta but q is on cpu"),
    ("write_kv k on meta", lambda: ops.write_kv(torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8),
                                                torch.ones(2, 1, 8, device=META), torch.ones(2, 1, 8), T([0, 1])),
     "k is on meta but k_cache is on cpu"),
    ("write_kv_mla slots on meta", lambda: ops.write_kv_mla(torch.zeros(2, 4, 1, 24), torch.ones(1, 16),
                                                            torch.ones(1, 8), T([0]).to(META)),
     "slot_mapping is on meta but kv_cache is on cpu"),
    ("write_rows rows on meta", lambda: ops.write_rows(torch.zeros(2, 2, 3), torch.ones(1, 3, device=META), T([0])),
     "rows is on meta but cache is on cpu"),
    ("indexer k on meta", lambda: ops.indexer_scores(torch.randn(2, 3, 8), torch.rand(2, 3),
                                                     torch.randn(5, 8, device=META), T([0, 0]), T([1, 2]), 2),
     "k is on meta but q is on cpu"),
    ("sparse q on meta", lambda: ops.sparse_mla_attention_with_lse(torch.randn(2, 4, 24, device=META),
                                                                   torch.randn(10, 24), T([[0, 1], [2, -1]]),
                                                                   softmax_scale=0.1, v_head_dim=16),
     "latent_cache is on cpu but q is on meta"),
    ("merge list on two devices",
     lambda: ops.merge_attn_states([torch.zeros(2, 1, 4), torch.zeros(2, 1, 4, device=META)], [torch.zeros(2, 1)] * 2),
     "outs[1] is on meta but outs[0] is on cpu"),
    ("merge lses on meta", lambda: ops.merge_attn_states(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, device=META)),
     "lses is on meta but outs is on cpu"),
    ("merge_into partial on meta", lambda: merge_into(torch.zeros(2, 1, 4), torch.zeros(2, 1),
                                                      torch.zeros(2, 1, 4, device=META), torch.zeros(2, 1)),
     "out is on meta but out_acc is on cpu"),
    ("window q on meta", window(q=1), "k_cache is on cpu but q is on meta"),
    ("window sinks on meta", window(sinks=1), "sinks is on meta but q is on cpu"),
    ("mla_preprocess weight on meta", mlapo(T([5, -1, 0]), w_uk=1), "w_uk is on meta but hidden is on cpu"),
    ("mla_preprocess cache on meta", mlapo(T([5, -1, 0]), kv_cache=1), "kv_cache is on meta but hidden is on cpu"),
    ("gated_pool rows on meta", lambda: ops.gated_pool(torch.zeros(8, 2), torch.zeros(8, 2), torch.zeros(4, 2),
                                                       T([[0, 1, 2, 3]]).to(META)),
     "rows is on meta but kv is on cpu"),
    ("selection_mismatch on two devices", lambda: selection_mismatch(T([[0, 1]]), T([[0, 1]]).to(META)),
     "b is on meta but a is on cpu"),
    # PCP layout and pcp_prefill
    ("pcp_plan float lengths", lambda: pcp_plan([0, 2.5, 5], 2),
     "cu_seqlens must hold integers (token counts); got 2.5 (float) at index 1"),
    ("pcp_plan float tensor", lambda: pcp_plan(T([0.0, 4.0]), 2), "cu_seqlens must be a 1-D integer tensor"),
    ("pcp_plan nonzero start", lambda: pcp_plan([2, 4], 2), "cu_seqlens must start at 0; got cu_seqlens[0] = 2"),
    ("pcp_plan decreasing", lambda: pcp_plan([0, 5, 3], 2), "got cu_seqlens[1] = 5 > cu_seqlens[2] = 3"),
    ("pcp_plan size 0", lambda: pcp_plan([0, 4], 0), "pcp_size must be >= 1; got 0"),
    ("pcp_plan float size", lambda: pcp_plan([0, 4], 2.0), "pcp_size must be an integer; got 2.0"),
    ("pcp_plan negative context", lambda: pcp_plan([0, 4, 6], 2, context_lens=[3, -1]), "context_lens[1] = -1"),
    ("pcp_plan context length", lambda: pcp_plan([0, 4, 6], 2, context_lens=[3]),
     "context_lens must hold 2 entries (one per request); got 1"),
    ("pcp_shard rank past plan", lambda: pcp_shard(torch.arange(8), pcp_plan([0, 8], 2), 2),
     "rank must be in 0..1 (the plan's ranks: 2); got 2"),
    ("pcp_shard negative rank", lambda: pcp_shard(torch.arange(8), pcp_plan([0, 8], 2), -1),
     "rank must be in 0..1"),
    ("pcp_shard wrong tokens", lambda: pcp_shard(torch.arange(7), pcp_plan([0, 8], 2), 0),
     "x must be a packed [T=8, ...] tensor"),
    ("pcp_unshard parts", lambda: pcp_unshard([torch.zeros(4)], pcp_plan([0, 8], 2)), "needs 2 parts"),
    ("pcp_prefill plan type", prefill(plan=[0, 4]), "plan must be a PCPPlan"),
    ("Context cu past k", lambda: Context(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), T([0, 5])),
     "Context.cu_seqlens ends at 5 but Context.k has 3 tokens"),
    ("Context requests", prefill(context=Context(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), T([0, 1, 3]))),
     "Context.cu_seqlens covers 2 requests but the plan has 1"),
    # DCP layout, plan, decode, context
    ("dcp_owner float", lambda: dcp_owner(T([0.0, 1.0]), 2, 1), "t must be an integer tensor"),
    ("dcp_owner negative", lambda: dcp_owner(T([0, -1]), 2, 1), "t[1] = -1; expected a position / length >= 0"),
    ("dcp_local_lens negative", lambda: dcp_local_lens(T([4, -3]), 2, 1), "seq_lens[1] = -3"),
    ("dcp sizes float", lambda: dcp_local_lens(T([4]), 1.5, 1), "dcp_size must be an integer; got 1.5"),
    ("slot map request past table", lambda: dcp_slot_mapping(T([0, 1]), T([0, 3]), T([[0, 1]]), dcp_rank=0,
                                                             dcp_size=1, interleave_size=1, block_size=2),
     "req_indices[1] = 3; expected a row of block_table (0..0)"),
    ("slot map rank", lambda: dcp_slot_mapping(T([0]), T([0]), T([[0]]), dcp_rank=2, dcp_size=2,
                                               interleave_size=1, block_size=2), "dcp_rank must be in [0, 2)"),
    ("reshard interleave", lambda: reshard_kv_blocks(torch.zeros(2, 4), dcp_size=2, interleave_size=1,
                                                     block_size=4), "interleave_size == block_size"),
    ("dcp_plan float lens", lambda: dcp_plan([4.5], [1], T([[0, 1]]), dcp_size=2, interleave_size=1, block_size=4),
     "seq_lens must hold integers (token counts); got 4.5 (float) at index 0"),
    ("dcp_plan query > seq", lambda: dcp_plan([2], [3], T([[0, 1]]), dcp_size=2, interleave_size=1, block_size=4),
     "request 0: query_lens[0] = 3, seq_lens[0] = 2; need 0 <= query_lens <= seq_lens"),
    ("dcp_plan size 0", lambda: dcp_plan([2], [1], T([[0]]), dcp_size=0, interleave_size=1, block_size=4),
     "dcp_size must be >= 1; got 0"),
    ("dcp_plan table narrow", lambda: dcp_plan([40], [1], T([[0, 1]]), dcp_size=2, interleave_size=1, block_size=4),
     "widen the block table"),
    ("dcp_plan float table", lambda: dcp_plan([4], [1], T([[0.0]]), dcp_size=1, interleave_size=1, block_size=4),
     "block_table must be an integer tensor [B, max_blocks]"),
    ("dcp_decode rows", lambda: dcp_decode(torch.zeros(2, 2, 8), (torch.zeros(2, 4, 1, 8),) * 2,
                                           dcp_plan([4], [1], T([[0]]), dcp_size=1, interleave_size=1, block_size=4),
                                           group=one()), "q must be [T=1, Hl, Dk]"),
    ("dcp_decode latent without v_head_dim", lambda: dcp_decode(
        torch.zeros(1, 2, 8), torch.zeros(2, 4, 1, 8), dcp_plan([4], [1], T([[0]]), dcp_size=1, interleave_size=1,
                                                                 block_size=4), group=one()),
     "an MLA latent cache [..., 8] needs v_head_dim in 1..8"),
    ("dcp_decode meta type", lambda: dcp_decode(torch.zeros(1, 2, 8), (torch.zeros(2, 4, 1, 8),) * 2, [4],
                                                group=one()), "meta must be a DCPMeta"),
    ("DCPContext context past table", dcp_ctx(ctx_lens=(9,)),
     "context_lens[0] = 9 puts 9 cached tokens on DCP rank 0, but a block_table row addresses 1 x 4 = 4 slots"),
    ("DCPContext negative context", dcp_ctx(ctx_lens=(-2,)),
     "context_lens[0] = -2; expected a count of cached tokens >= 0"),
    ("DCPContext cu_q end", dcp_ctx(cu=(0, 5)), "cu_q ends at 5 but q has 2 rows; its last entry must equal 2"),
    ("DCPContext block in table past cache", dcp_ctx(table=((7,),)), "block_table[0, 0] = 7 is read by query row 0"),
    # DSA primitives
    ("dsa_attention cu_q rows", dsa_one(cu_q=(0, 2)), "cu_seqlens_q ends at 2 but q has 3 tokens; its last entry "
                                                      "must equal 3"),
    ("dsa_attention cu_k past latent", dsa_one(cu_k=(0, 5)), "cu_seqlens_k ends at 5 but latent has 3 rows"),
    ("dsa_cp_plan float", lambda: dsa_cp_plan([0, 3.0], 2), "cu_seqlens must hold integers"),
    ("dsa_cp_plan size", lambda: dsa_cp_plan([0, 3], 0), "cp_size must be >= 1; got 0"),
    ("dsa_cp_plan overlapping cache", lambda: dsa_cp_plan([0, 3, 5], 2, cache_starts=[0, 2]),
     "cache_starts[1] = 2 puts request 1 inside request 0's cache rows 0..2"),
    ("dsa_cp_plan negative context", lambda: dsa_cp_plan([0, 3], 2, context_lens=[-1]), "context_lens[0] = -1"),
    ("pcp_shard rank", lambda: pcp_shard(torch.arange(3), dsa_cp_plan([0, 3], 2), 2),
     "rank must be in 0..1 (the plan's ranks: 2); got 2"),
    ("dcp_shard_keys rank", lambda: dcp_shard_keys(torch.zeros(4, 8), torch.zeros(4, 2), [0, 4], 2, 2),
     "rank must be in 0..1 (the DCP group's ranks: 2); got 2"),
    ("dcp_shard_keys cu past latent", lambda: dcp_shard_keys(torch.zeros(4, 8), torch.zeros(4, 2), [0, 6], 0, 2),
     "cu_seqlens_k ends at 6 but latent has 4 rows"),
    ("dsa_dcp_topk negative position", topk_args(positions=(0, -1, 2)), "positions[1] = -1"),
    ("dsa_dcp_topk cu_q rows", topk_args(cu_q=(0, 2)), "cu_seqlens_q ends at 2 but q_index has 3 queries"),
    ("dsa_dcp_topk ids order", topk_args(ids=(0, 2, 1)),
     "keys.ids must be strictly ascending within each request; got keys.ids[2] = 1 after keys.ids[1] = 2"),
    ("dsa_dcp_attention q rows",
     lambda: dsa_dcp_attention(torch.randn(2, 4, 24), torch.randn(3, 2, 8), torch.rand(3, 2), T([0, 1, 2]), [0, 3],
                               dcp_shard_keys(torch.randn(3, 24), torch.randn(3, 8), [0, 3], 0, 1), group=one(),
                               topk=2, softmax_scale=0.1, v_head_dim=16), "q must be [T=3, H, Dqk]"),
]


@pytest.mark.parametrize("call, fragment", [pytest.param(c, f, id=i) for i, c, f in ROWS])
def test_bad_input_is_a_named_value_error(call, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)) as info:
        call()
    assert type(info.value) is ValueError
    assert len(str(info.value)) < 400  # the first offender, never a dump


def test_the_same_inputs_done_right_run():
    """The rows above differ from valid calls only in the bad value: the valid ones run."""
    att()()
    paged()()
    paged(table=((0, 1, 99),))()  # an unread table entry may hold any id
    paged(table=((0, -1),), lens=(3, 4))()  # a -1 past the visible keys is fine
    wkv(T([3, -1]))()
    wkv(T([-1, 5, -1, -1, 4]))()  # -1 (a token another DCP rank owns, a padding row) may repeat
    mlapo(T([-1, 5, -1]))()
    ops.write_rows(torch.zeros(2, 2, 3), torch.ones(3, 3), T([-1, 3, -1]))
    sparse(T([[0, -1, -1, -1], [9, 3, -1, -1]]))()  # -1 padding may repeat; the rows of one query are distinct
    sparse(T([[4, 5, 6, 7], [4, 5, 6, 7]]))()  # two queries may select the same rows
    window()()
    indexer()()
    sparse(T([[0, 9], [1, -1]]))()
    dsa_one()()
    topk_args()()
    dcp_ctx(ctx_lens=(4,))()
    assert pcp_shard(torch.arange(8), pcp_plan(T([0, 8], dtype=torch.int32), 2), 1).tolist() == [2, 3, 4, 5]


def test_a_repeated_slot_is_refused_before_anything_is_written():
    """The check runs before the write: a refused call leaves the cache as it was."""
    kc, vc = torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8)
    with pytest.raises(ValueError, match=re.escape("slot_mapping[1] = 2 repeats slot_mapping[0]")):
        ops.write_kv(kc, vc, torch.ones(2, 1, 8), torch.full((2, 1, 8), 2.0), T([2, 2]))
    assert not kc.any() and not vc.any()


def test_meta_tensors_on_one_device_only_propagate_shapes():
    """All arguments on meta is one device: value checks are skipped (no values) and the fake kernels answer."""
    kc = torch.zeros(3, 4, 2, 8, device=META)
    out, lse = ops.paged_attention_with_lse(torch.randn(2, 4, 8, device=META), kc, kc, T([[0, 1]]).to(META),
                                            T([0, 0]).to(META), T([3, 6]).to(META))
    assert (out.device, out.shape, lse.shape) == (META, (2, 4, 8), (2, 4))
    ops.write_kv(kc, kc.clone(), torch.ones(2, 2, 8, device=META), torch.ones(2, 2, 8, device=META),
                 T([1, 1]).to(META))
    q, cache = torch.randn(2, 4, 24, device=META), torch.randn(10, 24, device=META)
    out, _ = ops.sparse_mla_attention_with_lse(q, cache, T([[0, 0], [1, 2]]).to(META), softmax_scale=0.1,
                                               v_head_dim=16)
    assert out.shape == (2, 4, 16) and out.device == META


@pytest.mark.slow
def test_checks_are_skipped_inside_torch_compile():
    """A compiled program calling write_kv traces whole (fullgraph: no graph break from a check's host read),
    matches eager on valid slots, and does not check values at run time (that is the plan step's job)."""
    def step(kc, vc, k, v, slots):
        ops.write_kv(kc, vc, k, v, slots)
        return kc.sum(dim=(1, 2, 3)) + vc.sum(dim=(1, 2, 3))

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    k, v = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    want = [torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)]
    got = [torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)]
    expect = step(*want, k, v, T([5, -1, 0]))
    torch.testing.assert_close(compiled(*got, k, v, T([5, -1, 0])), expect, rtol=0, atol=0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="repeats"):  # eager refuses it ...
        step(*got, k, v, T([5, -1, 5]))
    compiled(*got, k, v, T([5, -1, 5]))  # ... the captured program never reads the slots on the host
