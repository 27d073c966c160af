"""Elastic CP's measured threshold (``pcp_min_tokens="measure"``, :mod:`cpattn.engine.elastic_measure`).

- :func:`threshold` against a brute-force reading of its rule (hypothesis: any times per length);
- on a simulated world of 2 and 4 threads and on 2 gloo ranks: every rank gets the same threshold, one of
  the timed lengths or NEVER; the served engine starts empty (no step, no block in use) and its tokens equal
  one-device greedy generation whatever the threshold came out as;
- refusals in one line: without a world, a bad value, with ``pcp_policy="always"``; ``cpattn serve
  --pcp-min-tokens measure`` under the ``uni`` executor (threads) and ``--pcp-min-tokens soon`` exit 2.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lanes import examples
from test_serve_flags import _free_port, _refusal

import cpattn
from cpattn.config import SchedulerConfig
from cpattn.engine.elastic import NEVER
from cpattn.engine.elastic_measure import lengths, measure, threshold
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.models import qwen3

CFG = qwen3.Qwen3Config.tiny()
PARAMS = qwen3.init_params(CFG, seed=3)
BUDGET = 256  # lengths 64, 128, 256: a second or so per world


@settings(max_examples=examples(200))
@given(st.lists(st.tuples(st.floats(0.001, 1.0), st.floats(0.001, 1.0)), min_size=1, max_size=8))
def test_threshold_is_the_shortest_length_from_which_pcp_always_wins(times):
    lens = [64 << i for i in range(len(times))]
    pcp, other = [a for a, _ in times], [b for _, b in times]
    got = threshold(lens, pcp=pcp, other=other)
    winning = [n for i, n in enumerate(lens) if all(pcp[j] < other[j] for j in range(i, len(lens)))]
    assert got == (winning[0] if winning else NEVER)


def test_lengths_double_up_to_the_budget_and_stop_at_8k():
    assert lengths(256) == [64, 128, 256]
    assert lengths(300) == [64, 128, 256]
    assert lengths(1) == [64]
    assert lengths(1 << 20)[-1] == 8192


def _served(group, prompts, n):
    engine = LLMEngine("qwen3", PARAMS, CFG, world=group, pcp_size=group.size, dcp_size=group.size, block_size=4,
                       num_blocks=64, pcp_policy="elastic", pcp_min_tokens="measure",
                       scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=4))
    chosen = engine.runners[0].pcp_min_tokens
    fresh = (engine.stats.steps, engine.stats.blocks_used)
    outs = engine.generate(prompts, SamplingParams(max_tokens=n))
    used_at_end = engine.stats.blocks_used
    engine.close()
    return chosen, fresh, [list(o.token_ids) for o in outs], used_at_end


PROMPTS = [list(range(1, 40)), [5, 6, 7], list(range(9, 200))]


@pytest.mark.parametrize("size", [2, 4])
def test_every_rank_agrees_and_the_engine_serves_exact_tokens(size, one_device, one_thread):
    outs = cpattn.simulate(size, _served, PROMPTS, 3)
    chosen = {o[0] for o in outs}
    assert len(chosen) == 1 and chosen.pop() in (*lengths(BUDGET), NEVER)
    for _, (steps, used), tokens, used_at_end in outs:
        assert steps == 0 and used == 0 and used_at_end == 0  # the timing ran in a scratch engine; no leak
        assert tokens == [one_device.tokens("qwen3", PARAMS, CFG, p, 3) for p in PROMPTS]


@pytest.mark.slow
def test_on_gloo_ranks_every_rank_agrees(one_device):
    from cpattn.comm.launch import spawn

    outs = spawn(2, _served, PROMPTS, 3, threads=1, timeout_s=300)
    assert outs[0][0] == outs[1][0] and outs[0][0] in (*lengths(BUDGET), NEVER)
    assert outs[0][2] == outs[1][2] == [one_device.tokens("qwen3", PARAMS, CFG, p, 3) for p in PROMPTS]


def test_measure_without_a_world_is_refused():
    with pytest.raises(ValueError, match='pcp_min_tokens="measure" times the engine\'s ranks, so it needs world='):
        LLMEngine("qwen3", PARAMS, CFG, pcp_size=2, dcp_size=2, block_size=4, num_blocks=16, pcp_policy="elastic",
                  pcp_min_tokens="measure")


@pytest.mark.parametrize("policy,value,said", [
    ("elastic", "soon", "expected an int >= 0, 'measure'"),
    ("elastic", -1, "expected an int >= 0, 'measure'"),
    ("always", "measure", "with pcp_policy='always'"),
])
def test_bad_values_are_refused(policy, value, said):
    with pytest.raises(ValueError, match=said):
        LLMEngine("qwen3", PARAMS, CFG, pcp_size=2, dcp_size=2, block_size=4, num_blocks=16, pcp_policy=policy,
                  pcp_min_tokens=value)


def test_measure_refuses_no_world_directly():
    with pytest.raises(ValueError, match="needs world="):
        measure("qwen3", PARAMS, CFG, None, pcp_size=2, dcp_size=2, block_size=4, interleave_size=1, budget=64)


@pytest.mark.parametrize("argv,said", [
    (["--pcp-min-tokens", "measure", "--distributed-executor-backend", "uni"],
     ["argument --pcp-min-tokens", "measure with --distributed-executor-backend uni", "add --distributed-executor"]),
    (["--pcp-min-tokens", "soon"], ["argument --pcp-min-tokens", "'soon'", "or 'measure'"]),
])
def test_serve_flag_refusals_exit_2(argv, said, capsys):
    err = _refusal(["--pcp", "2", "--dcp", "2", "--pcp-policy", "elastic", *argv, "--port", str(_free_port())],
                   capsys)
    assert err.startswith("cpattn serve: error: argument --"), err
    for piece in said:
        assert piece in err, (piece, err)


@pytest.mark.parametrize("slow,expected", [("pcp", NEVER), ("other", 64)])
def test_the_measured_threshold_reads_the_slowest_rank(slow, expected, monkeypatch):
    """One rank of two made 50 ms slower on one path: the decision follows that rank's times (the slowest
    rank's medians), whichever path it is -- PCP never wins, or wins from the first length."""
    import time as clock

    from cpattn.engine import runner as runner_mod
    from cpattn.engine import runner_dp

    module, name = (runner_mod, "run_prefill_rows") if slow == "pcp" else (runner_dp, "execute_with_dp")
    real = getattr(module, name)

    def slow_on_rank_1(runner, *a, **kw):
        if runner.group.rank == 1:
            clock.sleep(0.05)
        return real(runner, *a, **kw)

    monkeypatch.setattr(module, name, slow_on_rank_1)
    got = cpattn.simulate(2, lambda g: measure("qwen3", PARAMS, CFG, g, pcp_size=2, dcp_size=2, block_size=4,
                                               interleave_size=1, budget=128, reps=1))
    assert got == [expected, expected]
