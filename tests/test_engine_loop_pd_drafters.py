"""P/D in the step loop with drafters that read the target's hidden states (MTP, Eagle3; DSpark too).

The producer (P ranks, its chunks under PCP) keeps each request's prompt hidden rows; the P/D connector sends
those of the positions the consumer does not compute (its usable blocks) with the blocks, producer rank
``d % P`` -> consumer rank d (in memory for PDEngine, over Group send / recv for run_rank). The consumer's
drafter then starts from every prompt position, as in one engine that ran the prompt.

Checks, per layout (P/D 1-1, 2-1, 1-2, 2-2), k = 1 and 2, requests arriving at different steps, prompts of
1 .. 17 tokens (chunked by a budget of 16):

- tokens equal one-device greedy, recomputed here plainly (each token the argmax of the last row of a full
  dense one-device prefill of the prompt and the tokens so far);
- every proposal (history -> drafts) and the drafted / accepted counts equal the colocated LLMEngine's with
  the same drafter (prefix caching off there, so its drafter reads every prompt position);
- the hidden bytes sent are the hand count: per handed request, D consumer ranks x its usable blocks'
  positions x the rows' widths;
- ``cpattn.engine.generate`` of a P/D layout with MTP / Eagle3 runs the step loop and equals
  ``composed(...)``: tokens equal, logits within 1e-9 (float64; measured ~1e-14), SpecStats drafted /
  accepted equal.

Targets and heads are the shipped tiny trained ones (tests/data/speculative, spec_methods_cases.py), float64,
so drafts get accepted and greedy ties cannot flip.
"""

from __future__ import annotations

import functools

import pytest
import torch
from spec_methods_cases import TARGET_OF, Recorder, head, target
from spec_methods_cases import prompts as corpus_prompts
from ref.greedy import ONE_DEVICE

import cpattn
from cpattn.config import SchedulerConfig
from cpattn.engine.batch import Prompts
from cpattn.engine.composed import composed
from cpattn.engine.connector_pd import PDConnector, usable_blocks
from cpattn.engine.hidden_rows import hidden_names
from cpattn.engine.driver import engine_configs, generate, step_loop_runs
from cpattn.engine.family import get_family
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.pd_engine import PDEngine
from cpattn.engine.run_rank import Arrival, run_rank

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
BLOCK = 4
LOGIT_TOL = dict(rtol=0, atol=1e-9)


@functools.lru_cache(maxsize=None)
def model(method: str):
    """(family name, cfg, float64 params) of the method's shipped target."""
    return target(TARGET_OF[method])


def greedy(method: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The one-device greedy recompute of tests/ref/greedy.py (conftest's ``one_device``): n tokens."""
    name, cfg, params = model(method)
    return tuple(ONE_DEVICE.tokens(name, params, cfg, list(prompt), n))


def schedule(method: str, shared: bool = False) -> list[dict]:
    """Six requests over four steps: corpus prompts of 13, 6 and 1 tokens (drafts get accepted), a random 9,
    a 17-token one (chunked by the budget) and a 5; request 5 has max_tokens=1 (done on the producer).
    No two prompts share a whole block, unless ``shared``: then request 4 starts with request 0's first 12
    tokens (3 blocks the producer finds cached)."""
    ps = corpus_prompts(TARGET_OF[method])
    long = ps[0][:12] + ps[3][:5] if shared else ps[0][::-1] + ps[3][:4]
    return [dict(prompt=p, max_tokens=m, arrive=a) for p, m, a in
            ((ps[0], 9, 0), (ps[1], 8, 0), (ps[2], 6, 1), (ps[3], 9, 1), (long, 7, 3), (ps[1][1:6], 1, 3))]


def params_of(r: dict) -> SamplingParams:
    return SamplingParams(max_tokens=r["max_tokens"])


def sched(**over) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 4, **over})


def serve(engine, reqs: list[dict]) -> dict:
    """Feed the arrivals (``arrive``: the step), step until drained: {index: final RequestOutput}."""
    ids, final, step = {}, {}, 0
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrive"])
    while pending or engine.has_unfinished():
        while pending and reqs[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            ids[engine.add_request(reqs[i]["prompt"], params_of(reqs[i]))] = i
        final.update({ids[o.request_id]: o for o in engine.step() if o.finished})
        step += 1
        assert step < 500
    return final


def proposals(rec: Recorder) -> dict:
    """{history: drafts} of every proposal a recorded drafter made."""
    return {tuple(h): tuple(d) for hs, ds in rec.log for h, d in zip(hs, ds)}


@functools.lru_cache(maxsize=None)
def colocated(method: str, k: int, shared: bool = False):
    """The one-engine run of the schedule with the same drafter: (proposals, drafted, accepted); prefix caching
    on only for the ``shared`` schedule."""
    name, cfg, params = model(method)
    rec = Recorder(head(method))
    engine = LLMEngine(name, params, cfg, block_size=BLOCK, num_blocks=64, drafter=rec, num_speculative_tokens=k,
                       scheduler=sched(enable_prefix_caching=shared))
    final = serve(engine, schedule(method, shared))
    assert engine.stats.prefix_hit_tokens == (12 if shared else 0)
    for i, r in enumerate(schedule(method, shared)):
        assert final[i].token_ids == greedy(method, tuple(r["prompt"]), r["max_tokens"]), f"colocated request {i}"
    return handed_only(proposals(rec), schedule(method, shared)), engine.stats.drafted_tokens, \
        engine.stats.accepted_tokens


def handed_only(drafts: dict, reqs: list[dict]) -> dict:
    """One engine's proposals less those after a max_tokens=1 request's only token (drafted, never verified;
    under P/D the producer serves it, without a drafter)."""
    done = {tuple(r["prompt"]) for r in reqs if r["max_tokens"] == 1}
    return {h: d for h, d in drafts.items() if h[:-1] not in done}


def hidden_hand_count(method: str, reqs: list[dict], d: int, hits: dict | None = None) -> dict:
    """Hidden bytes per handed request, by hand: D consumer ranks x the positions from the producer's prefix
    hit (``hits``: request -> tokens; none) to the end of the usable blocks x the widths of the drafter's rows
    (every name is a [T, hidden_size] residual row here), float64."""
    _, cfg, _ = model(method)
    width = len(hidden_names(head(method).hidden_layers)) * cfg.hidden_size
    return {i: d * (usable_blocks(len(r["prompt"]), BLOCK, d) * BLOCK - (hits or {}).get(i, 0)) * width * 8
            for i, r in enumerate(reqs) if r["max_tokens"] > 1}


CASES = [(m, p, d, k) for m, ks in (("mtp", (1, 2, 1, 2)), ("eagle3", (2, 1, 2, 1)))
         for (p, d), k in zip(((1, 1), (2, 1), (1, 2), (2, 2)), ks)]


@pytest.mark.parametrize("method,p,d,k", CASES, ids=[f"{m}-{p}x{d}-k{k}" for m, p, d, k in CASES])
def test_pd_engine_drafts_as_one_engine(method, p, d, k):
    name, cfg, params = model(method)
    reqs = schedule(method)
    rec = Recorder(head(method))
    pd = PDEngine(name, params, cfg, pcp_size=p, dcp_size=d, block_size=BLOCK, num_blocks=64, poison=True,
                  kv_connector=PDConnector(), drafter=rec, num_speculative_tokens=k, scheduler=sched())
    final = serve(pd, reqs)
    for i, r in enumerate(reqs):
        assert final[i].token_ids == greedy(method, tuple(r["prompt"]), r["max_tokens"]), f"request {i}"
    want, drafted, accepted = colocated(method, k)
    got = proposals(rec)
    assert got == want  # the consumer's drafter state is the one engine's: the same drafts after every history
    s = pd.stats.decode
    assert (s.drafted_tokens, s.accepted_tokens) == (drafted, accepted) and accepted > 0
    st = pd.prefill.connector.stats
    hand = hidden_hand_count(method, reqs, d)
    assert st.hidden_bytes_sent == sum(hand.values()) > 0
    assert pd.decode.connector.stats.hidden_bytes_received == st.hidden_bytes_sent
    assert not pd.decode.connector._hidden_in and pd.stats.decode.blocks_used == 0
    pd.close()


def test_pd_engine_default_pool_carries_hidden_rows_too():
    """PDEngine's default (an in-process pool for the blocks) adds the P/D connector for the hidden rows: the
    pool serves every block, the connector sends rows only; DSpark (hidden rows of its target layers) too."""
    for method in ("eagle3", "dspark"):
        name, cfg, params = target("qwen3")
        reqs = schedule("eagle3")
        rec = Recorder(head(method))
        pd = PDEngine(name, params, cfg, pcp_size=2, dcp_size=2, block_size=BLOCK, num_blocks=64, drafter=rec,
                      num_speculative_tokens=2, scheduler=sched())
        final = serve(pd, reqs)
        for i, r in enumerate(reqs):
            assert final[i].token_ids == greedy("eagle3", tuple(r["prompt"]), r["max_tokens"]), f"{method} {i}"
        member = pd.prefill.connector.member(PDConnector)
        assert member.stats.blocks_sent == 0 and member.stats.hidden_bytes_sent > 0
        if method == "dspark":  # its own one-engine run: the same proposals
            one = Recorder(head(method))
            engine = LLMEngine(name, params, cfg, block_size=BLOCK, num_blocks=64, drafter=one,
                               num_speculative_tokens=2, scheduler=sched(enable_prefix_caching=False))
            serve(engine, reqs)
            assert proposals(rec) == handed_only(proposals(one), reqs)
            assert pd.stats.decode.accepted_tokens == engine.stats.accepted_tokens > 0
        pd.close()


def test_a_prefix_the_producer_found_cached_starts_the_drafter_there():
    """Request 4 shares request 0's first 3 blocks: the producer (P = 1) finds them cached and computes (so keeps
    hidden rows of) positions 12.. only, so those are all that go over; the consumer's drafter starts at 12, as
    the one engine's does after its own prefix hit (a freed draft slot starts afresh: no error on reuse)."""
    name, cfg, params = model("mtp")
    reqs = schedule("mtp", shared=True)
    rec = Recorder(head("mtp"))
    pd = PDEngine(name, params, cfg, pcp_size=1, dcp_size=2, block_size=BLOCK, num_blocks=64, poison=True,
                  kv_connector=PDConnector(), drafter=rec, num_speculative_tokens=2, scheduler=sched())
    final = serve(pd, reqs)
    for i, r in enumerate(reqs):
        assert final[i].token_ids == greedy("mtp", tuple(r["prompt"]), r["max_tokens"]), f"request {i}"
    want, drafted, accepted = colocated("mtp", 2, shared=True)
    assert proposals(rec) == want
    assert (pd.stats.decode.drafted_tokens, pd.stats.decode.accepted_tokens) == (drafted, accepted)
    assert pd.stats.prefill.prefix_hit_tokens == 12  # request 4: 3 blocks
    hand = hidden_hand_count("mtp", reqs, 2, hits={4: 12})
    assert pd.prefill.connector.stats.hidden_bytes_sent == sum(hand.values())
    pd.close()


# -- cpattn.engine.generate: P/D with MTP / Eagle3 through the step loop, against the composition ------------------
@pytest.mark.parametrize("method,p,d,k", [("mtp", 2, 2, 2), ("eagle3", 2, 1, 1)], ids=str)
def test_generate_pd_with_a_hidden_state_drafter_is_the_composition(method, p, d, k):
    name, cfg, params = model(method)
    prompts = [r["prompt"] for r in schedule(method)[:4]]
    pre, dec = engine_configs(name, cfg, pcp_size=p, dcp_size=d, pd=True, block_size=BLOCK, interleave_size=BLOCK,
                              num_speculative_tokens=k, speculative_method=method)
    drafter = head(method)
    assert step_loop_runs(get_family(name), cfg, pre, dec, drafter)  # generate takes the step loop
    want = composed(get_family(name), params, cfg, Prompts.of(prompts), 7, prefill=pre, decode=dec, drafter=drafter)
    got = generate(name, params, cfg, prompts, 7, prefill=pre, decode=dec, drafter=drafter)
    assert torch.equal(got.tokens, want.tokens)
    assert got.tokens.tolist() == [list(greedy(method, tuple(q), 7)) for q in prompts]
    assert got.logits.shape == want.logits.shape
    torch.testing.assert_close(got.logits, want.logits, **LOGIT_TOL)
    assert (got.stats.drafted, got.stats.accepted) == (want.stats.drafted, want.stats.accepted)
    assert got.stats.accepted > 0


# -- run_rank: the hidden rows rank to rank over the world -----------------------------------------------------------
def arrivals(reqs: list[dict]) -> list[Arrival]:
    return [Arrival(r["prompt"], params_of(r), r["arrive"]) for r in reqs]


def pd_rank(world, method, kwargs):
    """run_rank of the method's schedule (the target and head loaded here, so a spawned rank has them): the
    final tokens, the drafts this rank's drafter proposed, its role's drafted / accepted counts and its
    connector's hidden bytes sent / received."""
    name, cfg, params = model(method)
    rec, seen = Recorder(head(method)), []
    finals = run_rank(world, name, params, cfg, arrivals(schedule(method)), drafter=rec, **kwargs,
                      on_step=lambda role, e, outs: seen.append(e))
    e = seen[-1]
    st = e.connector.stats
    return ({i: tuple(o.token_ids) for i, o in finals.items()}, proposals(rec),
            (e.stats.drafted_tokens, e.stats.accepted_tokens), (st.hidden_bytes_sent, st.hidden_bytes_received))


def check_ranks(res, method: str, p: int, d: int, k: int) -> None:
    reqs = schedule(method)
    tokens = {}
    for finals, _, _, _ in res:
        for i, t in finals.items():
            assert tokens.setdefault(i, t) == t, f"ranks disagree on request {i}"
    assert tokens == {i: greedy(method, tuple(r["prompt"]), r["max_tokens"]) for i, r in enumerate(reqs)}
    want, drafted, accepted = colocated(method, k)
    for r in range(p, p + d):  # every consumer rank's replicated drafter: the one engine's drafts and counts
        assert res[r][1] == want and res[r][2] == (drafted, accepted), f"consumer rank {r - p}"
    hand = sum(hidden_hand_count(method, reqs, d).values())
    assert sum(res[r][3][0] for r in range(p)) == hand
    assert sum(res[r][3][1] for r in range(p, p + d)) == hand


@pytest.mark.parametrize("method,p,d,k", [("mtp", 2, 2, 2), ("eagle3", 1, 2, 1)], ids=str)
def test_run_rank_pd_on_the_simulated_mesh(method, p, d, k):
    kw = dict(pd=True, pcp_size=p, dcp_size=d, block_size=BLOCK, scheduler=sched(), poison=True, num_blocks=64,
              num_speculative_tokens=k)
    check_ranks(cpattn.simulate(p + d, pd_rank, method, kw), method, p, d, k)


@pytest.mark.slow
def test_gloo_ranks_send_the_hidden_rows_rank_to_rank():
    """P/D 2 -> 2 in spawned processes with Eagle3 (k = 2): the rows go producer rank d % 2 -> consumer rank d over
    gloo send / recv; tokens one device's, proposals and counts the one engine's, bytes the hand count."""
    from cpattn.comm.launch import spawn

    kw = dict(pd=True, pcp_size=2, dcp_size=2, block_size=BLOCK, scheduler=sched(), poison=True, num_blocks=64,
              num_speculative_tokens=2)
    check_ranks(spawn(4, pd_rank, "eagle3", kw), "eagle3", 2, 2, 2)
