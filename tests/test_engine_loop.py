"""The step loop (LLMEngine = Scheduler + BlockManager + StepRunner) against one-device greedy generation.

The oracle: conftest.py's ``one_device`` (:mod:`ref.greedy`) of each request alone: each token the argmax of a
fresh one-device full prefill's last row, no cache carried, no chunking, no parallelism, no engine code.
Whatever the arrivals, the token budget (so the chunk boundaries), the batch mix, preemptions, prefix-cache
hits and aborts, each request's tokens must equal it (float64 weights: the chunked and the whole-prompt
attention differ in their last bits only). Freshly handed-out blocks are
NaN-poisoned, so a read of stale or never-written rows turns the logits NaN and the tokens wrong.
"""

from __future__ import annotations

import functools

import pytest
import torch
from engine_loop_cases import gloo_rank, run_schedule
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpattn.config import SchedulerConfig
from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.family import get_family
from cpattn.engine.llm import LLMEngine, SamplingParams

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine
MAX_TOKENS = 6  # the reference is computed once per prompt at this length; shorter requests take a prefix


@functools.lru_cache(maxsize=None)
def model(family: str, heads: int | None = None):
    """A tiny float64 model; ``heads``: query heads (6 lets a DCP / TP size of 3 divide them)."""
    fam = get_family(family)
    cfg = fam.config_class.tiny(**({} if heads is None else {"num_attention_heads": heads}))
    return cfg, fam.init_params(cfg, seed=1, dtype=torch.float64)


def reference(one_device, family: str, prompt: tuple[int, ...], heads: int | None = None) -> list[int]:
    """MAX_TOKENS one-device greedy tokens of ``prompt`` alone (``one_device``: conftest.py's session oracle)."""
    cfg, params = model(family, heads)
    return one_device.tokens(family, params, cfg, list(prompt), MAX_TOKENS)


def expected(one_device, family: str, req: dict, heads: int | None = None) -> list[int]:
    """One-device greedy tokens of the request alone: max_tokens of them, cut after the first stop token."""
    ref = reference(one_device, family, tuple(req["prompt"]), heads)[: req["max_tokens"]]
    for j, t in enumerate(ref):
        if t in req.get("stop", ()):
            return ref[: j + 1]
    return ref


def check_run(one_device, family: str, engine: LLMEngine, schedule: list[dict], heads: int | None = None) -> list:
    """Run the schedule; assert every request's tokens, the replay rule and that no block leaks."""
    ids, steps = run_schedule(engine, schedule)
    for i, rid in ids.items():
        got, want = list(engine.scheduler.requests[rid].output), expected(one_device, family, schedule[i], heads)
        if "abort" in schedule[i]:
            assert want[: len(got)] == got, f"aborted request {i}: {got} is not a prefix of {want}"
        else:
            assert got == want, f"request {i} (prompt {len(schedule[i]['prompt'])} tokens): {got} != {want}"
            stopped = want[-1] in schedule[i].get("stop", ())  # a stop token wins over max_tokens (vLLM)
            assert engine.scheduler.requests[rid].finish_reason == ("stop" if stopped else "length")
    for out, replayed in steps:
        assert not (replayed and not out.uniform_decode), f"a step with {out.eager_reason} replayed"
        graph = engine.runners[0].graph
        if graph is not None and out.uniform_decode and out.query_lens[0] == graph.q_len and \
                out.num_scheduled_tokens <= graph.sizes[-1]:
            assert replayed, f"a uniform decode step of {out.num_scheduled_tokens} tokens ran eagerly"
    s = engine.stats
    assert (s.blocks_used, s.running, s.waiting) == (0, 0, 0), s
    assert s.replayed_steps + s.eager_steps == s.steps == len([o for o, _ in steps if o.req_ids])
    return steps


def shared_schedule(vocab: int, seed: int = 0) -> list[dict]:
    """Five requests: two share 18 prompt tokens, one repeats an earlier prompt, arrivals spread over steps."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    base = toks(18)
    first = base + toks(5)
    return [dict(prompt=first, max_tokens=5, arrive=0), dict(prompt=toks(3), max_tokens=6, arrive=0),
            dict(prompt=base + toks(9), max_tokens=4, arrive=3), dict(prompt=toks(30), max_tokens=3, arrive=4),
            dict(prompt=list(first), max_tokens=6, arrive=9)]


@pytest.mark.parametrize("family,dcp,interleave,heads,pcp", [
    ("qwen3", 2, 1, None, False),
    ("qwen3", 3, 2, 6, True),  # DCP 3: uneven shares of every span; chunks under PCP 3
    pytest.param("qwen3_moe", 3, 1, None, False, marks=pytest.mark.slow),
    pytest.param("deepseek_v2", 2, 2, None, True, marks=pytest.mark.slow),  # MLA: values in the keys
    pytest.param("deepseek_v3", 2, 4, None, False, marks=pytest.mark.slow),
    pytest.param("deepseek_v32", 2, 1, None, True, marks=pytest.mark.slow),  # DSA-CP chunks, indexer keys paged
    pytest.param("glm_moe_dsa", 2, 2, None, False, marks=pytest.mark.slow),
])
def test_every_family_serves_a_mixed_schedule_exactly(one_device, family, dcp, interleave, heads, pcp):
    """Chunked prefill beside decodes (chunks under DCP attention, or PCP with their cached context),
    prefix hits, captured uniform decode steps, DCP-sharded blocks."""
    cfg, params = model(family, heads)
    engine = LLMEngine(family, params, cfg, dcp_size=dcp, pcp_size=dcp if pcp else 1, block_size=4,
                       interleave_size=interleave,
                       graph_mode="FULL_DECODE_ONLY", num_blocks=24, poison=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=3))
    steps = check_run(one_device, family, engine, shared_schedule(cfg.vocab_size), heads)
    s = engine.stats
    assert s.prefix_hit_tokens >= 4 * dcp * ((18 // (4 * dcp))), s  # the shared 18 tokens' full spans
    assert s.replayed_steps > 0 and s.eager_steps > 0, s
    assert any(o.is_prefill and not o.samples[0] for o, _ in steps if o.req_ids), "no partial chunk ran"
    assert s.bytes_sent > 0  # DCP merges moved partials
    assert (s.pcp_steps > 0) == pcp, s


def test_preemption_recomputes_exactly(one_device):
    """A pool too small for the running requests: the newest is preempted, recomputed, still exact."""
    cfg, params = model("qwen3")
    g = torch.Generator().manual_seed(5)
    sched = [dict(prompt=torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), max_tokens=6, arrive=0)
             for n in (7, 9, 6)]
    engine = LLMEngine("qwen3", params, cfg, dcp_size=1, block_size=2, num_blocks=8, poison=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=3))
    check_run(one_device, "qwen3", engine, sched)
    assert engine.stats.preemptions > 0


def test_stop_token_and_abort(one_device):
    cfg, params = model("qwen3")
    g = torch.Generator().manual_seed(7)
    p1, p2 = (torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 12))
    stop = reference(one_device, "qwen3", tuple(p1))[2]
    sched = [dict(prompt=p1, max_tokens=6, arrive=0, stop=[stop]), dict(prompt=p2, max_tokens=6, arrive=0, abort=3)]
    engine = LLMEngine("qwen3", params, cfg, dcp_size=2, block_size=4, num_blocks=8,
                       scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2))
    check_run(one_device, "qwen3", engine, sched)
    reqs = engine.scheduler.requests
    assert reqs[0].finish_reason == "stop" and reqs[0].output[-1] == stop and len(reqs[0].output) <= 3
    assert reqs[1].finish_reason == "abort"


def test_poison_reaches_stale_blocks(one_device):
    """The poisoning the exactness tests rely on is real: a block handed out anew is NaN where not written."""
    cfg, params = model("qwen3")
    engine = LLMEngine("qwen3", params, cfg, block_size=4, num_blocks=4, poison=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=1,
                                                 enable_prefix_caching=False))
    run_schedule(engine, [dict(prompt=list(range(1, 14)), max_tokens=2, arrive=0)])  # fills 4 blocks (14 tokens)
    k = engine.runners[0].shard.k[0]
    assert not k[:3].isnan().any()  # blocks 0..2 written by the first request
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    out = engine.step()
    first = engine.last_step[0].block_tables[0][0]
    assert out[0].token_ids == tuple(expected(one_device, "qwen3", dict(prompt=[1, 2, 3], max_tokens=1)))
    assert not k[first, :3].isnan().any() and k[first, 3:].isnan().all()  # stale row 3 poisoned, never read


def test_bad_requests_are_refused_before_a_step():
    cfg, params = model("qwen3")
    engine = LLMEngine("qwen3", params, cfg, block_size=4, num_blocks=4,
                       scheduler=SchedulerConfig(max_num_batched_tokens=8, max_model_len=16))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, cfg.vocab_size])
    with pytest.raises(ValueError, match="int token ids"):
        engine.add_request([1, 2.5])  # refused, never truncated
    with pytest.raises(ValueError, match="max_model_len is 16"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):  # DeepSeek-V4: tests/test_engine_loop_v4.py
        LLMEngine("deepseek_v4", {}, get_family("deepseek_v4").config_class.tiny(), scheduler=SchedulerConfig())
    assert not engine.has_unfinished() and engine.stats.steps == 0


requests = st.lists(st.fixed_dictionaries({
    "len": st.integers(1, 40), "share": st.integers(0, 3), "shared": st.integers(0, 24),
    "max_tokens": st.integers(1, MAX_TOKENS), "arrive": st.integers(0, 8),
    "abort": st.one_of(st.none(), st.integers(0, 12)), "stop": st.booleans()}), min_size=1, max_size=6)


def draw_schedule(one_device, vocab: int, reqs: list[dict], seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in reqs:
        prompt = torch.randint(0, vocab, (r["len"],), generator=g).tolist()
        if r["share"] and out:  # share a prefix with an earlier request
            donor = out[r["share"] % len(out)]["prompt"]
            prompt = donor[: r["shared"]] + prompt
        req = dict(prompt=prompt, max_tokens=r["max_tokens"], arrive=r["arrive"])
        if r["abort"] is not None:
            req["abort"] = r["arrive"] + r["abort"]
        if r["stop"]:
            req["stop"] = [reference(one_device, "qwen3", tuple(prompt))[r["len"] % MAX_TOKENS]]
        out.append(req)
    return out


def property_run(one_device, reqs, dcp, block, budget, seqs, spare, chunked, graph, k, pcp, seed):
    cfg, params = model("qwen3")
    sched = draw_schedule(one_device, cfg.vocab_size, reqs, seed)
    span = block * dcp
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in sched)
    num_blocks = -(-longest // span) + spare  # small spare: preemptions
    if not chunked:
        budget = max(budget, longest)
    engine = LLMEngine("qwen3", params, cfg, dcp_size=dcp, pcp_size=dcp if pcp else 1, block_size=block,
                       num_blocks=num_blocks, poison=True,
                       graph_mode="FULL_DECODE_ONLY" if graph else "NONE", graph_backend="eager",
                       drafter=NgramDrafter() if k else None, num_speculative_tokens=k,
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                                 enable_chunked_prefill=chunked))
    check_run(one_device, "qwen3", engine, sched)


schedules = dict(reqs=requests, dcp=st.sampled_from([1, 2]), block=st.sampled_from([2, 4]),
                 budget=st.integers(1, 48), seqs=st.integers(1, 4), spare=st.integers(0, 12), chunked=st.booleans(),
                 graph=st.booleans(), k=st.sampled_from([0, 0, 2]), pcp=st.booleans(), seed=st.integers(0, 2**16))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(**schedules)
def test_any_schedule_gives_one_device_greedy_tokens(one_device, reqs, dcp, block, budget, seqs, spare, chunked, graph,
                                                     k, pcp, seed):
    property_run(one_device, reqs, dcp, block, budget, seqs, spare, chunked, graph, k, pcp, seed)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**schedules)
def test_any_schedule_gives_one_device_greedy_tokens_more(one_device, reqs, dcp, block, budget, seqs, spare, chunked,
                                                          graph, k, pcp, seed):
    property_run(one_device, reqs, dcp, block, budget, seqs, spare, chunked, graph, k, pcp, seed)


@pytest.mark.slow
def test_gloo_ranks_give_the_simulated_tokens(one_device):
    """Under real processes (gloo) every rank runs its own scheduler; the tokens equal the simulated run's."""
    from cpattn.comm.launch import spawn

    cfg, params = model("qwen3")
    sched = shared_schedule(cfg.vocab_size, seed=3)
    kwargs = dict(block_size=4, num_blocks=16, graph_mode="FULL_DECODE_ONLY", graph_backend="eager",
                  scheduler=dict(max_num_batched_tokens=8, max_num_seqs=3))
    per_rank = spawn(2, gloo_rank, "qwen3", cfg, 1, sched, kwargs)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == {i: expected(one_device, "qwen3", r) for i, r in enumerate(sched)}


@pytest.mark.parametrize("method,dcp,graph", [("ngram", 2, True), pytest.param("draft_model", 1, False,
                                                                                marks=pytest.mark.slow)])
def test_speculative_steps_stay_lossless(one_device, method, dcp, graph):
    """k drafts per running request verified in the same steps as prefill chunks; accepted ones committed,
    rejected KV rolled back; tokens still one-device greedy (repetitive prompts so drafts get accepted)."""
    from cpattn.drafters.draft_model import truncated

    cfg, params = model("qwen3")
    drafter = NgramDrafter() if method == "ngram" else truncated("qwen3", params, cfg, num_layers=1)
    g = torch.Generator().manual_seed(11)
    unit = torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()
    sched = [dict(prompt=unit * 4, max_tokens=6, arrive=0), dict(prompt=unit[:3] * 3, max_tokens=5, arrive=1),
             dict(prompt=torch.randint(0, cfg.vocab_size, (17,), generator=g).tolist(), max_tokens=6, arrive=2)]
    engine = LLMEngine("qwen3", params, cfg, dcp_size=dcp, block_size=4, num_blocks=24, poison=True,
                       graph_mode="FULL_DECODE_ONLY" if graph else "NONE", graph_backend="eager",
                       drafter=drafter, num_speculative_tokens=3,
                       scheduler=SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=3))
    steps = check_run(one_device, "qwen3", engine, sched)
    s = engine.stats
    assert s.drafted_tokens > 0 and 0 < s.accepted_tokens <= s.drafted_tokens, s
    assert any(max(o.query_lens) == 4 and not any(o.is_prefill) for o, _ in steps if o.req_ids)
    assert not engine.proposer.slots  # every slot given back


@pytest.mark.slow
def test_bench_engine_quick_reports_every_scenario(tmp_path):
    import json

    from cpattn.bench import engine as bench

    out = tmp_path / "engine.json"
    assert bench.main(["--quick", "--batches", "2", "--steps", "3", "--prompt", "256", "--chunk", "64",
                       "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["float32"]
    modes = {(r["scenario"], r["mode"], r.get("outputs")): r for r in rows["rows"]}
    for kind in ("final_only", "cumulative"):  # the default --output-kinds, side by side
        assert modes[("decode b=2", "captured", kind)]["replayed"] == 3
        assert modes[("decode b=2", "eager", kind)]["replayed"] == 0
    assert modes[("8 decodes + 64-token chunk", "eager", None)]["tokens"] == 64 + 8
    assert all(0 < r["host_frac"]["median"] < 1 for r in rows["rows"] if isinstance(r["host_frac"], dict))
    assert rows["ttft"]["ratio"]["median"] > 0


def test_bench_engine_refuses_a_chunk_longer_than_the_prompt(capsys):
    from cpattn.bench import engine as bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--prompt", "100", "--chunk", "200"])
    assert e.value.code == 2 and "--chunk" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.main(["--output-kinds", "final_only,all"])
    assert e.value.code == 2 and "--output-kinds" in capsys.readouterr().err


@pytest.mark.slow
def test_a_long_prompt_in_many_chunks_under_pcp(one_device):
    """A 2000-token prompt in 300-token chunks (each under PCP 2 with its DCP-sharded cached context) beside
    a short request's decodes: both one-device greedy."""
    cfg, params = model("qwen3")
    g = torch.Generator().manual_seed(13)
    sched = [dict(prompt=torch.randint(0, cfg.vocab_size, (2000,), generator=g).tolist(), max_tokens=4, arrive=0),
             dict(prompt=torch.randint(0, cfg.vocab_size, (9,), generator=g).tolist(), max_tokens=6, arrive=1)]
    engine = LLMEngine("qwen3", params, cfg, dcp_size=2, pcp_size=2, block_size=16, num_blocks=72, poison=True,
                       scheduler=SchedulerConfig(max_num_batched_tokens=300, max_num_seqs=2))
    check_run(one_device, "qwen3", engine, sched)
    assert engine.stats.pcp_steps >= 7


def test_generate_drains_a_fixed_batch_like_the_driver():
    """engine.generate = every prompt at step 0, stepped to the end: the fixed-batch driver's tokens
    (PCP 2 + DCP 2 in both)."""
    from cpattn.engine.driver import engine_configs, generate

    cfg, params = model("qwen3")
    prompts = [list(range(1, 12)), [5, 6, 7], list(range(40, 70))]
    p_cfg, d_cfg = engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2)
    fixed = generate("qwen3", params, cfg, prompts, 5, prefill=p_cfg, decode=d_cfg)
    engine = LLMEngine("qwen3", params, cfg, dcp_size=2, pcp_size=2, block_size=4, num_blocks=24,
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3))
    outs = engine.generate(prompts, SamplingParams(max_tokens=5))
    assert [list(o.token_ids) for o in outs] == fixed.tokens.tolist()
    assert [o.finish_reason for o in outs] == ["length"] * 3 and engine.stats.blocks_used == 0


@pytest.mark.parametrize("dcp", [1, 2])
def test_the_kv_pool_is_the_prefix_caches_second_tier(one_device, tmp_path, dcp):
    """A second engine (a cold device cache) over the same LMDB pool fetches the first engine's spans instead of
    computing them (NaN-poisoned fresh blocks, so a span fetched wrong or not at all shows); tokens stay one-device
    greedy."""
    from cpattn.engine.pooling import PoolSpec

    cfg, params = model("qwen3")
    g = torch.Generator().manual_seed(17)
    shared = torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist()
    sched = [dict(prompt=shared + torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), max_tokens=4,
                  arrive=i) for i, n in enumerate((3, 7, 1))]
    spec = PoolSpec(f"lmdb:{tmp_path / 'pool'}")

    def engine():
        return LLMEngine("qwen3", params, cfg, dcp_size=dcp, block_size=4, interleave_size=4, num_blocks=12,
                         poison=True, kv_pool=spec,
                         scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1))

    first = engine()
    check_run(one_device, "qwen3", first, sched)
    stored = first.stats.pool_blocks_stored
    assert stored > 0
    first.close()
    second = engine()  # a fresh device cache: every full span of the shared prefix comes from the pool
    check_run(one_device, "qwen3", second, sched)
    span = 4 * dcp
    assert second.stats.pool_hit_tokens >= (20 // span) * span, second.stats
    second.close()


@pytest.mark.parametrize("method,pcp", [("mtp", False), pytest.param("eagle3", True, marks=pytest.mark.slow),
                                        pytest.param("dspark", False, marks=pytest.mark.slow)])
def test_drafters_that_read_hidden_states_stay_lossless(one_device, method, pcp):
    """MTP (DeepSeek-V3 target), Eagle3 and DSpark (Qwen3) heads, trained checkpoints: the drafter gets the
    target's final hidden rows of every chunk and accepted decode row. Every proposal equals the head's drafts
    recomputed from scratch (no cache, the hidden states of one dense prefill of the history); tokens are
    one-device greedy; drafts get accepted."""
    from spec_methods_cases import TARGET_OF, Recorder, head, prompts, reference_drafts, target

    name, cfg, params = target(TARGET_OF[method])
    drafter = Recorder(head(method))
    ps = prompts(name)
    sched = [dict(prompt=p, max_tokens=6, arrive=i) for i, p in enumerate(ps)]
    engine = LLMEngine(name, params, cfg, dcp_size=2, pcp_size=2 if pcp else 1, block_size=4, num_blocks=24,
                       poison=True, drafter=drafter, num_speculative_tokens=2,
                       scheduler=SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=3))
    ids, _ = run_schedule(engine, sched)
    for i, rid in ids.items():
        ref = one_device.tokens(name, params, cfg, sched[i]["prompt"], 6)
        assert list(engine.scheduler.requests[rid].output) == ref, (method, i)
    s = engine.stats
    assert s.drafted_tokens > 0 and s.accepted_tokens > 0 and s.blocks_used == 0, s
    assert drafter.log
    for histories, drafts in drafter.log:
        for h, d in zip(histories, drafts):
            assert d == reference_drafts(drafter.drafter, name, params, cfg, h, 2), (method, len(h))
