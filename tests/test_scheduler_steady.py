"""The steady decode step (:func:`cpattn.engine.decode_rows.steady_output`: the previous decode step again, one
token on, built from that step's fields) gives exactly the general code's SchedulerOutput and state: over
hypothesis schedules of long decodes with requests waiting past the sequence cap, arrivals, aborts between
schedule and update, stop tokens, prefix caching, DCP spans and a block pool small enough that a step's
growth finds the free list short (then the general code preempts)."""

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cpattn.engine import decode_rows
from cpattn.engine.blocks import BlockManager
from cpattn.engine.scheduler import ModelOutput, Scheduler
from cpattn.engine.step_inputs import OneTokenRows


def state(s: Scheduler):
    reqs = {rid: (tuple(r.tokens), r.num_computed, r.status, r.finish_reason, tuple(r.drafts), tuple(r.keys))
            for rid, r in s.requests.items()}
    return reqs, {rid: s.blocks.table_ids(rid) for rid in s.requests}, s.stats, s.blocks.stats


@pytest.fixture
def steady_count(monkeypatch):
    """Counts the steps steady_output built (and those that grew a block table)."""
    real, counts = decode_rows.steady_output, {"steady": 0, "grew": 0}

    def counted(sched):
        before = sched.blocks.changes
        out = real(sched)
        if out is not None:
            counts["steady"] += 1
            counts["grew"] += sched.blocks.changes != before
        return out

    monkeypatch.setattr(decode_rows, "steady_output", counted)
    return counts


def drive(fast: Scheduler, slow: Scheduler, rng: random.Random, arrivals: dict, steps: int, abort_p: float,
          stop_p: float = 0.02) -> None:
    """Both schedulers in lockstep; the fast one gets OneTokenRows wherever the runner would hand them."""
    for k in range(steps):
        for prompt, max_tokens in arrivals.get(k, ()):
            for s in (fast, slow):
                s.add_request(prompt, max_tokens=max_tokens, stop_token_ids=(3,))
        if not fast.has_unfinished() and k > max(arrivals, default=0):
            break
        a, b = fast.schedule(), slow.schedule()
        assert a == b and a.uniform_decode == b.uniform_decode
        assert state(fast) == state(slow)
        toks = [3 if rng.random() < stop_p else rng.randrange(4, 9) for _ in a.req_ids]  # 3: the stop token
        if a.req_ids and rng.random() < abort_p:  # aborted after scheduling, before the update
            victim = rng.choice(a.req_ids)
            fast.abort(victim), slow.abort(victim)
        if a.req_ids and rng.random() < abort_p:  # or a waiting one (it shows in the next step's finished)
            waiting = [r.req_id for r in fast.waiting]
            if waiting:
                victim = rng.choice(waiting)
                fast.abort(victim), slow.abort(victim)
        outs = {r: ModelOutput((t,) if ok else ()) for r, t, ok in zip(a.req_ids, toks, a.samples)}
        one = all(a.samples) and not any(a.draft_tokens)
        assert fast.update(OneTokenRows(a.req_ids, toks) if one else outs) == slow.update(outs)
        assert state(fast) == state(slow)


@st.composite
def schedules(draw):
    block = draw(st.sampled_from([1, 2, 4]))
    dcp = draw(st.sampled_from([1, 2]))
    cap = draw(st.integers(1, 5))
    n = draw(st.integers(1, 8))
    reqs = [(draw(st.integers(0, 6)), [draw(st.integers(1, 8)) for _ in range(draw(st.integers(1, 9)))],
             draw(st.integers(1, 24))) for _ in range(n)]
    longest = max(len(p) + m - 1 for _, p, m in reqs)
    num_blocks = draw(st.integers(-(-longest // (block * dcp)), 4 * cap * -(-longest // (block * dcp))))
    return dict(block=block, dcp=dcp, cap=cap, budget=draw(st.integers(1, 16)), reqs=reqs, num_blocks=num_blocks,
                caching=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)), abort_p=draw(st.sampled_from([0, 0.05])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedules())
def test_steady_steps_equal_the_general_code(steady_count, w):
    def make():
        return Scheduler(BlockManager(w["num_blocks"], w["block"], dcp_size=w["dcp"], enable_caching=w["caching"]),
                         max_num_batched_tokens=w["budget"], max_num_seqs=w["cap"])
    fast, slow = make(), make()
    slow.fast_paths = False
    arrivals = {}
    for step, prompt, max_tokens in w["reqs"]:
        arrivals.setdefault(step, []).append((prompt, max_tokens))
    before = dict(steady_count)
    drive(fast, slow, random.Random(w["seed"]), arrivals, 400, w["abort_p"])
    assert not fast.has_unfinished() and fast.stats.blocks_used == 0
    event(f"steady steps: {'some' if steady_count['steady'] > before['steady'] else 'none'}")


def test_a_batch_of_long_decodes_runs_steady_and_grows_its_tables_in_steady_steps(steady_count):
    """32 requests decoding 40 tokens with 4 more waiting past the cap: after the first decode step every step
    is steady except those right after a request finishes; the steps whose tokens start a new span allocate."""
    def make():
        return Scheduler(BlockManager(36 * 6, 16, enable_caching=False), max_num_batched_tokens=2048,
                         max_num_seqs=32)
    fast, slow = make(), make()
    slow.fast_paths = False
    arrivals = {0: [([(7 * i + j) % 50 + 4 for j in range(60 + i % 3)], 40) for i in range(36)]}
    drive(fast, slow, random.Random(0), arrivals, 400, 0.0, stop_p=0.0)
    assert steady_count["steady"] >= 60 and steady_count["grew"] >= 3, steady_count


def test_a_short_free_list_falls_back_to_preemption(steady_count):
    """Two requests whose next tokens both start a span with one block free: not steady; the general code
    preempts the later one, as it would have."""
    def make():
        return Scheduler(BlockManager(5, 2, enable_caching=False), max_num_batched_tokens=8, max_num_seqs=2)
    fast, slow = make(), make()
    slow.fast_paths = False
    for s in (fast, slow):
        s.add_request([4, 5, 6], max_tokens=6)
        s.add_request([7, 8, 9], max_tokens=6)
    drive(fast, slow, random.Random(1), {}, 40, 0.0)
    assert fast.stats.preemptions == slow.stats.preemptions >= 1
    assert steady_count["steady"] >= 1
