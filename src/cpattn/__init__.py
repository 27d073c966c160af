"""cpattn: context-parallel attention for LLM inference in PyTorch.

Pure functions: tensors, a plan and a communication group go in, tensors
come out. See README.md and DESIGN.md.

>>> from cpattn import pcp_prefill, pcp_plan, simulate
"""

# public names -> the module that defines them, imported on first use (PEP 562), so that `import cpattn.X`
# costs only X: the command line parses (and refuses a typo) before torch is imported
_EXPORTS = {
    **dict.fromkeys(("Group", "simulate"), "cpattn.comm"),
    **dict.fromkeys(("EngineConfig", "ParallelConfig"), "cpattn.config"),
    **dict.fromkeys((
        "DSACache", "DSACPPlan", "ShardedKeys", "dcp_shard_keys", "dsa_attention", "dsa_cp_attention",
        "dsa_cp_plan", "dsa_cp_sparse_attention", "dsa_cp_work", "dsa_dcp_attention", "dsa_dcp_topk",
        "exchange_topk"
    ), "cpattn.dsa"),
    **dict.fromkeys(("DecodeRunner", "Field", "capture_sizes", "check_static"), "cpattn.graphs"),
    **dict.fromkeys(("DCPContext", "DCPMeta", "dcp_decode", "dcp_plan"), "cpattn.dcp"),
    **dict.fromkeys((
        "dcp_local_index", "dcp_local_lens", "dcp_owner", "dcp_slot_mapping", "reshard_kv_blocks",
        "unshard_kv_blocks"
    ), "cpattn.layout.dcp"),
    **dict.fromkeys(("PCPPlan", "pcp_plan", "pcp_shard", "pcp_unshard"), "cpattn.layout.pcp"),
    **dict.fromkeys((
        "attention_with_lse", "indexer_scores", "merge_attn_states", "paged_attention_with_lse",
        "sparse_mla_attention_with_lse", "topk_indices", "write_kv", "write_kv_mla"
    ), "cpattn.ops"),
    **dict.fromkeys(("Context", "pcp_prefill"), "cpattn.pcp"),
}


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

from cpattn._lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
