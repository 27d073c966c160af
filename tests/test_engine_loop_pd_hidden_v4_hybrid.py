"""P/D in the step loop of DeepSeek-V4 and a hybrid model (Qwen3-Next) with a drafter that reads the target's
hidden states: V4 with DSpark (its streams [n_hc, H] of layers 0 and 1), Qwen3-Next with its MTP module.

Their consumers compute no prompt token (the producer hands over the whole state after the prompt:
:mod:`cpattn.engine.connector_v4`, :mod:`cpattn.engine.connector_hybrid`), so the producer keeps every prompt
position's hidden rows and the P/D connector sends them after the state
(:class:`~cpattn.engine.hidden_rows.HiddenRowsMixin`); the consumer's runner hands them back as its handed
prompt rows' own, so the drafter's first proposal reads every prompt position, as in one engine that ran it.

Checks, P/D 1-1, 2-2, 1-2, 2-1 with k = 1 and 2, requests arriving at different steps (one with max_tokens=1,
done on the producer; Qwen3-Next's 13-token prompt placed in chunks by the consumer's budget of 12):

- tokens: one-device greedy (conftest.py's ``one_device``, tests/ref/greedy.py);
- every proposal equals the colocated LLMEngine's with the same drafter: history -> drafts, and the hidden
  rows the drafter was handed (start, count, values within 1e-12, float64);
- the drafted / accepted counts equal the colocated engine's, accepted > 0;
- hidden bytes sent: by hand, D consumer ranks x L prompt positions x the rows' width x 8 per handed request;
- rows broken on their way (the consumer's received rows shifted) change what the drafter reads: the check
  above fails (:func:`test_broken_rows_fail_the_check`);
- run_rank on the simulated mesh and over gloo (slow): the rows go rank to rank over Group send / recv.

``cpattn.engine.generate`` of these layouts runs the step loop and equals ``composed``:
tests/test_step_generate.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from spec_methods_cases import V4_CFG, v4_prompts, v4_target

import cpattn
from cpattn.config import SchedulerConfig
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.pd_engine import PDEngine
from cpattn.engine.run_rank import Arrival, run_rank

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
BLOCK = 4
ROW_TOL = 1e-12  # the rows a P/D drafter reads vs the colocated one's, float64


@functools.cache
def model(family: str):
    """(cfg, float64 params) of the family's target."""
    if family == "deepseek_v4":
        return V4_CFG, v4_target()
    from test_hybrid_mtp import model as hybrid_model

    return hybrid_model()


@functools.cache
def head(family: str):
    """V4: a random float64 DSpark head (its drafts accepted and rejected on this target); Qwen3-Next: the
    identity-like MTP head of tests/test_hybrid_mtp.py (drafts repeats of the last token, read from its row)."""
    if family == "deepseek_v4":
        from cpattn.drafters.dspark import DSparkDrafter

        return DSparkDrafter.random(v4_target(), V4_CFG, block_size=4, mask_token_id=V4_CFG.vocab_size - 1,
                                    dtype=torch.float64)
    from test_hybrid_mtp import identity_head

    return identity_head()


def schedule(family: str) -> list[dict]:
    """V4: prompts of 13, 6, 1, 20 tokens; Qwen3-Next: 6, 6, 6 (continuations that repeat) and 13; arriving
    at steps 0, 0, 1, 2, and a fifth at step 2 with max_tokens=1 (the producer serves it)."""
    if family == "deepseek_v4":
        ps = v4_prompts()
    else:
        from test_hybrid_mtp import prompts

        ps = [*prompts(), list(range(3, 16))]
    return [dict(prompt=p, max_tokens=m, arrive=a) for p, m, a in
            ((ps[0], 7, 0), (ps[1], 7, 0), (ps[2], 6, 1), (ps[3], 7, 2), (ps[1][1:], 1, 2))]


def sched(family: str) -> SchedulerConfig:
    """V4: whole prompts (its runner's rule); Qwen3-Next: a budget of 12 tokens (chunks)."""
    if family == "deepseek_v4":
        return SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=4, enable_chunked_prefill=False,
                               enable_prefix_caching=False)
    return SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, enable_prefix_caching=False)


class Recorder:
    """A drafter wrapping ``drafter``: ``log`` holds each proposal's {history: (drafts, start, count, {name:
    [count, F]})}, the rows it was handed."""

    def __init__(self, drafter):
        self.drafter, self.log = drafter, {}
        self.method, self.settings, self.hidden_layers = drafter.method, drafter.settings, drafter.hidden_layers

    def start(self, num_requests, max_len, *, graph=None):
        return _Recording(self.drafter.start(num_requests, max_len, graph=graph), self.log)


class _Recording:
    def __init__(self, state, log):
        self.state, self.log = state, log

    def propose(self, histories, k, requests, hidden=None):
        drafts = self.state.propose(histories, k, requests, hidden)
        for i, h in enumerate(histories):
            v = hidden.valid[i]
            rows = {n: r[i, :v].clone() for n, r in hidden.rows.items()}
            self.log[tuple(h)] = (tuple(drafts[i].tolist()), hidden.start[i], v, rows)
        return drafts

    def rollback(self, requests, keep_lens):
        self.state.rollback(requests, keep_lens)


def serve(engine, reqs: list[dict]) -> dict:
    """Feed the arrivals (``arrive``: the step), step until drained: {index: final token ids}."""
    ids, final, step = {}, {}, 0
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrive"])
    while pending or engine.has_unfinished():
        while pending and reqs[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            ids[engine.add_request(reqs[i]["prompt"], SamplingParams(max_tokens=reqs[i]["max_tokens"]))] = i
        final.update({ids[o.request_id]: tuple(o.token_ids) for o in engine.step() if o.finished})
        step += 1
        assert step < 200
    return final


def check_tokens(one_device, family: str, final: dict) -> None:
    cfg, params = model(family)
    for i, r in enumerate(schedule(family)):
        want = one_device.tokens(family, params, cfg, list(r["prompt"]), r["max_tokens"])
        assert list(final[i]) == list(want), f"{family} request {i}"


@functools.cache
def colocated(family: str, k: int):
    """The one-engine run of the schedule with the same drafter: (its proposals less those after a max_tokens=1
    request's only token, never verified; under P/D the producer serves it without a drafter), drafted,
    accepted, final tokens."""
    cfg, params = model(family)
    rec = Recorder(head(family))
    engine = LLMEngine(family, params, cfg, block_size=BLOCK, num_blocks=64, drafter=rec, num_speculative_tokens=k,
                       scheduler=sched(family))
    final = serve(engine, schedule(family))
    done = {tuple(r["prompt"]) for r in schedule(family) if r["max_tokens"] == 1}
    log = {h: v for h, v in rec.log.items() if h[:-1] not in done}
    return log, engine.stats.drafted_tokens, engine.stats.accepted_tokens, final


def same_proposals(got: dict, want: dict) -> None:
    """Every proposal's drafts and handed rows (start, count, values) are the one engine's."""
    assert got.keys() == want.keys()
    for h, (drafts, start, n, rows) in want.items():
        g = got[h]
        assert g[:3] == (drafts, start, n), (len(h), g[:3], (drafts, start, n))
        for name, r in rows.items():
            assert g[3][name].shape == r.shape and (g[3][name] - r).abs().max().item() <= ROW_TOL, (len(h), name)


def hand_count(family: str, d: int, log: dict) -> int:
    """Hidden bytes sent, by hand: per handed request, D x its L prompt positions x the rows' width x 8."""
    width = sum(r.shape[-1] for r in next(iter(log.values()))[3].values())
    return sum(d * len(r["prompt"]) * width * 8 for r in schedule(family) if r["max_tokens"] > 1)


def pd_engine(family: str, p: int, d: int, k: int, rec: Recorder) -> PDEngine:
    cfg, params = model(family)
    return PDEngine(family, params, cfg, pcp_size=p, dcp_size=d, block_size=BLOCK, num_blocks=64, poison=True,
                    drafter=rec, num_speculative_tokens=k, scheduler=sched(family))


CASES = [(f, p, d, k) for f in ("deepseek_v4", "qwen3_next")
         for (p, d), k in zip(((1, 1), (2, 2), (1, 2), (2, 1)), (1, 2, 2, 1))]


@pytest.mark.parametrize("family,p,d,k", CASES, ids=[f"{f}-{p}x{d}-k{k}" for f, p, d, k in CASES])
def test_pd_engine_drafts_as_one_engine(one_device, family, p, d, k):
    rec = Recorder(head(family))
    pd = pd_engine(family, p, d, k, rec)
    final = serve(pd, schedule(family))
    check_tokens(one_device, family, final)
    want, drafted, accepted, _ = colocated(family, k)
    same_proposals(rec.log, want)  # the consumer's drafter reads what the one engine's read, and drafts the same
    s = pd.stats.decode
    assert (s.drafted_tokens, s.accepted_tokens) == (drafted, accepted) and accepted > 0
    st = pd.prefill.connector.stats
    assert st.hidden_bytes_sent == hand_count(family, d, want) == pd.decode.connector.stats.hidden_bytes_received
    assert not pd.decode.connector._hidden_in and not pd.prefill.connector._hidden_out
    assert s.blocks_used == 0
    pd.close()


def test_the_hybrid_consumer_hands_back_a_chunked_prompts_rows():
    """Qwen3-Next: the consumer places the 13-token prompt in chunks (budget 12), each chunk's rows handed back
    from the connector (positions begin .. end - 1 with begin > 0 for the second)."""
    rec = Recorder(head("qwen3_next"))
    pd = pd_engine("qwen3_next", 1, 2, 2, rec)
    conn, asked = pd.decode.connector, []
    rows_of = conn.hidden_rows
    conn.hidden_rows = lambda rid, end: asked.append(end) or rows_of(rid, end)
    serve(pd, schedule("qwen3_next"))
    assert any(0 < e < 13 for e in asked) and 13 in asked, asked
    same_proposals(rec.log, colocated("qwen3_next", 2)[0])
    pd.close()


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen3_next"])
def test_broken_rows_fail_the_check(family):
    """The consumer's received rows shifted by one position (the first row repeated) before its drafter reads
    them: the proposals' rows (and drafts) differ from the one engine's, so the checks above can fail."""
    rec = Recorder(head(family))
    pd = pd_engine(family, 1, 1, 2, rec)
    conn = pd.decode.connector
    recv = conn._recv_hidden

    def shifted(handed):
        recv(handed)
        for rid, (start, rows) in conn._hidden_in.items():
            conn._hidden_in[rid] = (start, {n: torch.cat([r[:1], r[:-1]]) for n, r in rows.items()})

    conn._recv_hidden = shifted
    serve(pd, schedule(family))
    with pytest.raises(AssertionError):
        same_proposals(rec.log, colocated(family, 2)[0])
    pd.close()


# -- run_rank: the rows rank to rank over the world ------------------------------------------------------------------
def pd_rank(world, family, kwargs):
    """run_rank of the family's schedule with a recorded drafter (the target and head built here, so a spawned
    rank has them): final tokens, this rank's proposals, its role's drafted / accepted, hidden bytes sent /
    received."""
    cfg, params = model(family)
    rec, seen = Recorder(head(family)), []
    arrivals = [Arrival(r["prompt"], SamplingParams(max_tokens=r["max_tokens"]), r["arrive"]) for r in schedule(family)]
    finals = run_rank(world, family, params, cfg, arrivals, drafter=rec, scheduler=sched(family), **kwargs,
                      on_step=lambda role, e, outs: seen.append(e))
    e = seen[-1]
    st = e.connector.stats
    return ({i: tuple(o.token_ids) for i, o in finals.items()}, rec.log,
            (e.stats.drafted_tokens, e.stats.accepted_tokens), (st.hidden_bytes_sent, st.hidden_bytes_received))


def check_ranks(res, family: str, p: int, d: int, k: int) -> None:
    want, drafted, accepted, final = colocated(family, k)
    tokens = {}
    for finals, _, _, _ in res:
        for i, t in finals.items():
            assert tokens.setdefault(i, t) == t, f"ranks disagree on request {i}"
    assert tokens == final  # the one engine's, which test_pd_engine_drafts_as_one_engine checks against one device
    for r in range(p, p + d):  # every consumer rank's replicated drafter: the one engine's proposals and counts
        same_proposals(res[r][1], want)
        assert res[r][2] == (drafted, accepted), f"consumer rank {r - p}"
    hand = hand_count(family, d, want)
    assert sum(res[r][3][0] for r in range(p)) == hand == sum(res[r][3][1] for r in range(p, p + d))


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen3_next"])
def test_run_rank_pd_on_the_simulated_mesh(family):
    kw = dict(pd=True, pcp_size=2, dcp_size=2, block_size=BLOCK, poison=True, num_blocks=64, num_speculative_tokens=2)
    check_ranks(cpattn.simulate(4, pd_rank, family, kw), family, 2, 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("family,p,d", [("deepseek_v4", 2, 2), ("qwen3_next", 2, 1)])
def test_gloo_ranks_send_the_rows_rank_to_rank(family, p, d):
    """P/D in spawned processes (k = 2): the rows go producer rank d % P -> consumer rank d over gloo."""
    from cpattn.comm.launch import spawn

    kw = dict(pd=True, pcp_size=p, dcp_size=d, block_size=BLOCK, poison=True, num_blocks=64, num_speculative_tokens=2)
    check_ranks(spawn(p + d, pd_rank, family, kw), family, p, d, 2)
