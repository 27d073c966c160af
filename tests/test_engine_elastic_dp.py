"""Elastic CP's data-parallel prefill (cpattn.engine.runner_dp): a step's short chunks run one rank each (a lone
one too; a chunk with cached context gets it gathered from the DCP shards), long ones PCP over the group;
tokens stay one-device greedy (tests/ref/greedy.py)."""

from __future__ import annotations

import pytest
import torch
from engine_loop_cases import run_schedule
from ref.greedy import ONE_DEVICE
from test_engine_loop import expected, model

from cpattn.config import SchedulerConfig
from cpattn.engine.elastic import NEVER
from cpattn.engine.kv_rows import row_width
from cpattn.engine.llm import LLMEngine
from cpattn.engine.runner_dp import assign

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine

MIN = 8  # pcp_min_tokens: chunks of fewer new tokens are short


def toks(g, vocab, n):
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def together(vocab):
    """Four short prompts at once, a long one with them, then two more short ones later (staggered)."""
    g = torch.Generator().manual_seed(5)
    return [dict(prompt=toks(g, vocab, n), max_tokens=m, arrive=a)
            for n, m, a in ((3, 4, 0), (5, 3, 0), (2, 5, 0), (6, 3, 0), (20, 3, 0), (4, 4, 3), (7, 3, 3))]


def engine(family, size, min_tokens=MIN, budget=40, heads=None):
    cfg, params = model(family, heads)
    return LLMEngine(family, params, cfg, dcp_size=size, pcp_size=size, block_size=4, num_blocks=60, poison=True,
                     pcp_policy="elastic", pcp_min_tokens=min_tokens,
                     scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8))


def dp_eligible(out, min_tokens=MIN):
    """Rows a step should prefill data-parallel: every short chunk, with or without cached context -- short:
    fewer than ``min_tokens`` new tokens, and fewer query-key pairs (new x (context + new / 2)) than a fresh
    ``min_tokens``-token chunk's."""
    def short(q, c):
        return q < min_tokens and 2 * q * c + q * q < min_tokens ** 2

    return [b for b, p in enumerate(out.is_prefill) if p and short(out.query_lens[b], out.context_lens[b])]


def check(family, size, reqs, heads=None, **kw):
    e = engine(family, size, heads=heads, **kw)
    ids, steps = run_schedule(e, reqs)
    assert {i: list(e.scheduler.requests[r].output) for i, r in ids.items()} == \
           {i: expected(ONE_DEVICE, family, r, heads) for i, r in enumerate(reqs)}
    stats = [r.dp_stats for r in e.runners]
    assert len({(s.steps, s.chunks, s.tokens) for s in stats}) == 1  # every rank ran the same DP steps
    want = [dp_eligible(o, kw.get("min_tokens", MIN)) for o, _ in steps]
    assert stats[0].steps == sum(bool(w) for w in want)
    assert stats[0].tokens == sum(o.query_lens[b] for (o, _), w in zip(steps, want) for b in w)
    assert (e.stats.dp_prefill_steps, e.stats.dp_prefill_tokens) == (stats[0].steps, stats[0].tokens)
    return e, steps, want


@pytest.mark.parametrize("size", [2, 3])
def test_short_prompts_prefill_one_rank_each_and_tokens_stay_exact(size):
    heads = 6 if size == 3 else None
    e, steps, want = check("qwen3", size, together(model("qwen3", heads)[0].vocab_size), heads=heads)
    assert e.runners[0].dp_stats.steps >= 2  # the burst at step 0 and the staggered pair at step 3
    assert e.stats.pcp_steps > 0  # the long prompt still ran PCP
    # bytes: the rows' all-to-all (each rank's rows by DCP owner p % N, padded to the largest sender-owner
    # count) and the logits all-gather (padded to the most chunks on a rank), (N - 1) shares sent
    cfg = e.runners[0].cfg
    width, item = row_width(e.runners[0].shard.layouts), 8  # float64 rows and logits
    sent = 0
    for (o, _), w in zip(steps, want):
        if w:
            owner = assign([o.query_lens[b] for b in w], size)
            pair = [[sum(1 for b, r in zip(w, owner) if r == j for p in range(o.query_lens[b]) if p % size == d)
                     for d in range(size)] for j in range(size)]
            m = max(map(max, pair))
            b_max = max(owner.count(j) for j in range(size))
            sent += (size - 1) * item * (m * width + b_max * cfg.vocab_size)
    assert e.runners[0].dp_stats.bytes_sent == sent > 0


def test_dsa_short_prompts_prefill_one_rank_each():
    e, _, _ = check("deepseek_v32", 2, together(model("deepseek_v32")[0].vocab_size)[:4])
    assert e.runners[0].dp_stats.steps == 1


@pytest.mark.parametrize("size", [2, 3])
def test_a_lone_short_prompt_and_chunks_with_context_run_data_parallel(size):
    """One short prompt per step; then a 12-token prompt cut by a budget of 5 into short chunks that continue
    their cached context (gathered from the DCP shards onto the rank that computes the chunk); then a prompt
    sharing whole spans with the first ones (a prefix hit) in a short chunk."""
    heads = 6 if size == 3 else None
    cfg, _ = model("qwen3", heads)
    g = torch.Generator().manual_seed(9)
    base = toks(g, cfg.vocab_size, 4 * size)
    reqs = [dict(prompt=base + toks(g, cfg.vocab_size, 1), max_tokens=3, arrive=0),
            dict(prompt=toks(g, cfg.vocab_size, 12), max_tokens=3, arrive=1),
            dict(prompt=base + toks(g, cfg.vocab_size, 3), max_tokens=4, arrive=6)]
    e, steps, want = check("qwen3", size, reqs, budget=5, min_tokens=MIN, heads=heads)
    assert e.runners[0].dp_stats.steps == sum(map(bool, want)) >= 4
    assert any(len(w) == 1 for w in want)  # a lone chunk ran on one rank
    assert any(o.context_lens[b] > 0 for (o, _), w in zip(steps, want) for b in w)  # with its context gathered
    assert e.stats.prefix_hit_tokens > 0 and e.stats.blocks_used == 0, e.stats


def test_never_threshold_sends_every_fresh_burst_data_parallel():
    cfg, _ = model("qwen3")
    reqs = together(cfg.vocab_size)
    e, _, _ = check("qwen3", 2, reqs, min_tokens=NEVER)
    assert e.stats.pcp_steps == 0 and e.runners[0].dp_stats.chunks >= 5


def test_assign_balances_tokens_deterministically():
    assert assign([5, 3, 3, 2], 2) == [0, 1, 1, 0]  # 5+2 against 3+3
    assert assign([1, 1, 1], 3) == [0, 1, 2]
    assert assign([4, 1], 3) == [0, 1]  # rank 2 idle


def test_a_partial_fresh_chunk_runs_data_parallel_then_continues_with_context():
    cfg, _ = model("qwen3")
    g = torch.Generator().manual_seed(3)
    # budget 10: 3 + 5 tokens, then 2 of the third prompt (a fresh partial chunk), its rest next step
    reqs = [dict(prompt=toks(g, cfg.vocab_size, n), max_tokens=3, arrive=0) for n in (3, 5, 6, 4)]
    e, steps, want = check("qwen3", 2, reqs, budget=10)
    first = steps[0][0]
    assert want[0] == [0, 1, 2] and first.samples[2] is False  # the partial chunk ran data-parallel
    assert any(o.context_lens[b] > 0 for o, _ in steps[1:] for b, p in enumerate(o.is_prefill) if p)


def test_seeded_sampling_matches_one_device():
    from cpattn.engine.sampling import SamplingParams

    cfg, params = model("qwen3")
    g = torch.Generator().manual_seed(21)
    prompts = [toks(g, cfg.vocab_size, n) for n in (3, 6, 5, 2)]

    def run(e):
        ids = [e.add_request(p, SamplingParams(max_tokens=4, temperature=0.9, top_k=20, seed=100 + i))
               for i, p in enumerate(prompts)]
        while e.has_unfinished():
            e.step()
        return [list(e.scheduler.requests[r].output) for r in ids], e

    one, _ = run(LLMEngine("qwen3", params, cfg, block_size=4, num_blocks=60,
                           scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8)))
    got, e = run(engine("qwen3", 2))
    assert got == one and e.runners[0].dp_stats.chunks == 4


@pytest.mark.parametrize("schedule", ["together", "shared"])
def test_with_captured_decodes_interleave_and_prefix_hits(schedule):
    """The replay rule (a DP step runs its other rows eagerly), interleaved DCP rows, prefix hits kept on
    today's path (chunks with cached context), no leaked block: tests/test_engine_loop.py's check_run."""
    from test_engine_loop import check_run, shared_schedule

    cfg, params = model("qwen3")
    e = LLMEngine("qwen3", params, cfg, dcp_size=2, pcp_size=2, block_size=4, interleave_size=2, num_blocks=60,
                  poison=True, graph_mode="FULL_DECODE_ONLY", pcp_policy="elastic", pcp_min_tokens=MIN,
                  scheduler=SchedulerConfig(max_num_batched_tokens=40 if schedule == "together" else 10,
                                            max_num_seqs=8))
    reqs = together(cfg.vocab_size) if schedule == "together" else shared_schedule(cfg.vocab_size)
    steps = check_run(ONE_DEVICE, "qwen3", e, reqs)
    want = [dp_eligible(o) for o, _ in steps]
    assert e.runners[0].dp_stats.steps == sum(bool(w) for w in want)
    assert e.stats.replayed_steps > 0
    if schedule == "together":
        assert e.runners[0].dp_stats.steps > 0
    else:
        assert e.stats.prefix_hit_tokens > 0


def test_hybrid_models_keep_todays_path():
    """Qwen3-Next's runner keeps per-request linear states: its short chunks still run DCP attention."""
    import test_engine_loop_hybrid as hy

    reqs = [dict(prompt=hy.prompt(n, s), max_tokens=3, arrive=0) for n, s in ((3, 1), (5, 2), (4, 3))]
    e = hy.engine("pcp2_dcp2", 40, pcp_policy="elastic", pcp_min_tokens=MIN,
                  scheduler=hy.sched(max_num_batched_tokens=40))
    ids, _ = run_schedule(e, reqs)
    assert [list(e.scheduler.requests[r].output) for r in ids.values()] == [hy.expected(ONE_DEVICE, r) for r in reqs]
    assert e.runners[0].dp_stats.steps == 0
