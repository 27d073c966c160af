"""Module-level rank functions and tiny models for the speculative / P-D / PCP+DCP tests (spawn pickles by name).

Imports cpattn only, so spawned ranks start fast.
"""

import torch

from cpattn.models import deepseek_v3, deepseek_v32, qwen3
from cpattn.models.generate import pcp_dcp_generate_on_rank, pd_generate_on_rank, speculative_generate_on_rank

VOCAB = 64


def tiny_qwen3():
    """Qwen3, 2 layers, 8 query heads (DCP sizes 1, 2, 4, 8), 2 KV heads, float64 so greedy ties cannot flip."""
    cfg = qwen3.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    return qwen3, qwen3.init_params(cfg, seed=0, std=0.3, dtype=torch.float64), cfg


def tiny_mla():
    cfg = deepseek_v3.DeepseekV3Config.tiny()
    return deepseek_v3, deepseek_v3.init_params(cfg, seed=1, dtype=torch.float64), cfg


def tiny_dsa():
    cfg = deepseek_v32.DeepseekV32Config.tiny()
    return deepseek_v32, deepseek_v32.init_params(cfg, seed=2, dtype=torch.float64), cfg


def prompts():
    """A repetitive prompt (n-gram drafting finds matches), a random one, and a one-token one."""
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    return [pattern * 4 + pattern[:2], torch.randint(0, VOCAB, (11,), generator=g).tolist(), [7]]


TINY = {"qwen3": tiny_qwen3, "mla": tiny_mla, "dsa": tiny_dsa}


def reference(one_device, name: str, new: int):
    """(model, params, cfg, the one-device greedy recompute of ``new`` tokens per prompt) of tiny model ``name``;
    ``one_device``: conftest.py's session oracle (:class:`ref.greedy.OneDevice`, memoized by the params'
    content), a :class:`ref.greedy.Greedy` with tokens [B, new] and logits [B, new, V] like a Generation's."""
    model, params, cfg = TINY[name]()
    return model, params, cfg, one_device(model.FAMILY, params, cfg, prompts(), new)


def spec_cases(group, cases):
    return [speculative_generate_on_rank(group, *a, **kw) for a, kw in cases]


def pd_cases(group, cases):
    return [pd_generate_on_rank(group, *a, **kw) for a, kw in cases]


def pcp_dcp_cases(group, cases):
    """Each case is (rank function, args, kwargs)."""
    return [fn(group, *a, **kw) for fn, a, kw in cases]
