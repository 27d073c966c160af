"""cpattn: context-parallel attention for LLM inference in PyTorch.

Pure functions: tensors, a plan and a communication group go in, tensors
come out. See README.md and DESIGN.md.

>>> from cpattn import pcp_prefill, pcp_plan, simulate
"""

from cpattn.comm import Group, simulate
from cpattn.config import EngineConfig, ParallelConfig
from cpattn.dsa import (
    DSACache, DSACPPlan, ShardedKeys, dcp_shard_keys, dsa_attention, dsa_cp_attention, dsa_cp_plan,
    dsa_cp_sparse_attention, dsa_cp_work, dsa_dcp_attention, dsa_dcp_topk, exchange_topk,
)
from cpattn.graphs import DecodeRunner, Field, capture_sizes, check_static
from cpattn.dcp import DCPContext, DCPMeta, dcp_decode, dcp_plan
from cpattn.layout.dcp import (
    dcp_local_index, dcp_local_lens, dcp_owner, dcp_slot_mapping, reshard_kv_blocks, unshard_kv_blocks,
)
from cpattn.layout.pcp import PCPPlan, pcp_plan, pcp_shard, pcp_unshard
from cpattn.ops import (
    attention_with_lse, indexer_scores, merge_attn_states, paged_attention_with_lse, sparse_mla_attention_with_lse,
    topk_indices, write_kv, write_kv_mla,
)
from cpattn.pcp import Context, pcp_prefill

__version__ = "0.1.0"

__all__ = [
    "Group", "simulate", "ParallelConfig", "EngineConfig",
    "PCPPlan", "pcp_plan", "pcp_shard", "pcp_unshard", "pcp_prefill", "Context",
    "attention_with_lse", "merge_attn_states",
    "DCPMeta", "DCPContext", "dcp_plan", "dcp_decode",
    "dcp_owner", "dcp_local_index", "dcp_local_lens", "dcp_slot_mapping", "reshard_kv_blocks", "unshard_kv_blocks",
    "paged_attention_with_lse", "write_kv", "write_kv_mla",
    "DSACache", "DSACPPlan", "ShardedKeys", "dcp_shard_keys", "dsa_attention", "dsa_cp_attention", "dsa_cp_plan",
    "dsa_cp_work", "dsa_cp_sparse_attention", "dsa_dcp_attention", "dsa_dcp_topk",
    "exchange_topk",
    "indexer_scores", "topk_indices", "sparse_mla_attention_with_lse",
    "DecodeRunner", "Field", "capture_sizes", "check_static",
]
