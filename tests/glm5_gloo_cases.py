"""Module-level rank functions for the GLM-5 / Qwen3-MoE graph tests on real gloo ranks (spawn pickles by name).

Imports cpattn only (not transformers), so the spawned ranks start fast.
"""

from __future__ import annotations

import torch

from cpattn.engine import driver
from cpattn.engine.batch import Prompts
from cpattn.engine.decode import decode_step, make_runner
from cpattn.engine.family import get_family
from cpattn.engine.options import Algorithms
from cpattn.models import glm_moe_dsa, qwen3_moe

PROMPTS = [list(range(3, 22)), [5, 9, 2, 7, 1, 1, 4], list(range(40, 53)), [8, 8]]
CAPTURE_SIZES = (2, 4)


def tiny(name: str):
    """(family, cfg, float32 params) of a tiny model whose DCP size 2 divides the heads."""
    if name == "glm_moe_dsa":  # one full, one shared layer, dense MLPs (Qwen3-MoE covers MoE): short compiles
        cfg = glm_moe_dsa.GlmMoeDsaConfig.tiny(num_hidden_layers=2, indexer_types=("full", "shared"),
                                               mlp_layer_types=("dense", "dense"))
    else:
        cfg = qwen3_moe.Qwen3MoeConfig.tiny()
    family = get_family(name)
    return family, cfg, family.init_params(cfg, seed=3, std=0.2)


def capture_vs_eager(group, name: str):
    """Prefill PROMPTS with PCP over the group, hand the KV to DCP shards (one for the graphs, one eager),
    capture the decode step with aot_eager at CAPTURE_SIZES, then for 1..4 requests run one step both ways.

    Returns per batch size B: (graph logits [B, V], eager logits [B, V], runner path, graph argmax [B],
    eager argmax [B], bytes the graph-free eager step sent).
    """
    family, cfg, params = tiny(name)
    prompts = Prompts.of(PROMPTS)
    pre, dec = driver.engine_configs(family, cfg, pcp_size=group.size, dcp_size=group.size, block_size=4,
                                     interleave_size=2, graph_mode="FULL_DECODE_ONLY", graph_backend="aot_eager",
                                     capture_sizes=CAPTURE_SIZES)
    out = driver.prefill_fn(group, family, params, cfg, prompts, Algorithms(), False)
    shards = [driver.new_shard(family, cfg, params, prompts, 2, dec, None) for _ in range(2)]
    for shard in shards:
        driver.handoff(group, group, group, shard, out)
    runner = make_runner(group, family, params, cfg, shards[0], num_speculative_tokens=0, max_requests=4,
                         capture_sizes=list(CAPTURE_SIZES), backend="aot_eager")
    first = out.first_logits.argmax(-1)
    lens = torch.tensor(prompts.prompt_lens)
    res = []
    for b in range(1, 5):
        batch = {"tokens": first[:b], "seq_lens": lens[:b] + 1, "block_table": shards[0].block_table[:b]}
        g_logits, g_arg = runner(batch, [1] * b)
        path = runner.stats.last
        group.stats.reset()
        e_logits, e_arg = decode_step({"params": params, "shard": shards[1]},
                                      {**batch, "cu_seqlens_q": torch.arange(b + 1, dtype=torch.int32)},
                                      family=family, cfg=cfg, group=group, merge="ag_rs")
        res.append((g_logits, e_logits, path, g_arg, e_arg, group.stats.total_sent()))
    return res


def capture_many(group, names: list[str]):
    """:func:`capture_vs_eager` for each family name, in one spawn."""
    return [capture_vs_eager(group, name) for name in names]
