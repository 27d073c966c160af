"""Scheduler: worked steps of each policy, then hypothesis schedules driven by a fake model.

The fake model keeps a KV store keyed by (block id, offset): each position
holds the chained hash of the request's tokens up to it, written when the
position is computed and read back (context position ``c - 1``) to continue
the chain, so a step that attends a wrong, stale or never-written block
samples other tokens. Sampled token = a fixed function of that chain; its
drafter proposes the true continuation with some drafts corrupted. The
oracle is the same function run on one request alone.
"""

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cpattn.engine.blocks import BlockManager, local_len
from cpattn.engine.scheduler import ModelOutput, Scheduler

V = 53  # vocabulary of the fake model
MOD = (1 << 61) - 1


def chain(h, t):
    return (h * 1000003 + t + 1) % MOD


def next_token(h):
    return (h * 2654435761 >> 17) % V


def reference(prompt, max_tokens, stop=()):
    """The request alone, greedy, one token at a time."""
    h = 0
    for t in prompt:
        h = chain(h, t)
    out = []
    while True:
        t = next_token(h)
        out.append(t)
        if t in stop or len(out) == max_tokens:
            return out
        h = chain(h, t)


class FakeModel:
    def __init__(self, span, k):
        self.span, self.k, self.kv = span, k, {}

    def run(self, step):
        outs = {}
        for b, rid in enumerate(step.req_ids):
            table, c, ids = step.block_tables[b], step.context_lens[b], step.input_ids[b]
            h = 0 if c == 0 else self.kv[table[(c - 1) // self.span], (c - 1) % self.span][0]
            targets = []
            for i, t in enumerate(ids):
                h = chain(h, t)
                self.kv[table[(c + i) // self.span], (c + i) % self.span] = (h, t)
                targets.append((next_token(h), h))
            if not step.samples[b]:
                outs[rid] = ModelOutput()
                continue
            drafts = step.draft_tokens[b]
            a = 0
            while a < len(drafts) and drafts[a] == targets[len(ids) - len(drafts) - 1 + a][0]:
                a += 1
            first = len(ids) - len(drafts) - 1
            sampled = [targets[first + j][0] for j in range(a + 1)]
            outs[rid] = ModelOutput(sampled, self.propose(sampled[-1], targets[first + a][1]))
        return outs

    def propose(self, bonus, h):
        drafts = []
        for i in range(self.k):
            h = chain(h, bonus if i == 0 else drafts[-1])
            t = next_token(h)
            drafts.append((t + 1) % V if (h >> 7) % 3 == 0 else t)  # about a third of drafts wrong
        return drafts


def sched(num_blocks=64, block_size=4, **kw):
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_num_seqs", 8)
    return Scheduler(BlockManager(num_blocks, block_size), **kw)


def test_chunked_prefill_splits_a_long_prompt_and_running_requests_go_first():
    s = sched(max_num_batched_tokens=8)
    a = s.add_request([1, 2], max_tokens=3)
    b = s.add_request(list(range(20)), max_tokens=1)
    out = s.schedule()
    assert out.req_ids == (a, b) and out.query_lens == (2, 6) and out.samples == (True, False)
    s.update({a: [5], b: []})
    out = s.schedule()  # a's decode, then b's next chunk over its 6 cached tokens
    assert out.query_lens == (1, 7) and out.context_lens == (2, 6) and out.is_prefill == (False, True)
    assert out.eager_reason == "row 1 (request 1) is a prefill chunk" and not out.uniform_decode
    s.update({a: [6], b: []})
    out = s.schedule()  # b's last 7 prompt tokens complete its prefill: its last position is sampled
    assert out.query_lens == (1, 7) and out.seq_lens == (4, 20) and out.samples == (True, True)
    assert s.update({a: [7], b: [9]}) == [a, b]
    out = s.schedule()
    assert out.req_ids == () and out.finished == (a, b) and out.eager_reason == "empty step"


def test_without_chunking_a_prompt_waits_for_a_whole_step_and_an_oversized_one_is_refused():
    s = sched(max_num_batched_tokens=10, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"may need 11 tokens in one step \(10 prompt \+ 2 max_tokens - 1.*"
                                         r"enable chunked prefill or raise max_num_batched_tokens"):
        s.add_request(list(range(10)), max_tokens=2)
    a = s.add_request(list(range(6)), max_tokens=2)
    b = s.add_request(list(range(10, 15)), max_tokens=1)
    out = s.schedule()
    assert out.req_ids == (a,) and out.query_lens == (6,)  # b (5) does not fit the 4 left: it waits
    s.update({a: [1]})
    out = s.schedule()
    assert out.req_ids == (a, b) and out.query_lens == (1, 5)


def test_preemption_takes_the_latest_admitted_and_puts_it_first_in_line():
    s = sched(num_blocks=5, block_size=1, max_num_batched_tokens=32, num_speculative_tokens=3)
    x = s.add_request([1], max_tokens=5)
    y = s.add_request([2], max_tokens=2)
    z = s.add_request([3], max_tokens=2)
    out = s.schedule()
    assert out.req_ids == (x, y, z) and s.blocks.num_free == 2
    s.update({x: ModelOutput([5], drafts=[6, 6, 6]), y: [6], z: [7]})
    out = s.schedule()  # x verifies 3 drafts: 4 new blocks, 2 free -> z (admitted last) goes, then y
    assert out.preempted == (z, y) and out.req_ids == (x,) and out.query_lens == (4,)
    assert [r.req_id for r in s.waiting] == [y, z] and s.stats.preemptions == 2
    assert s.requests[y].num_computed == 0 and s.blocks.block_table(y) == [] and s.output_tokens(y) == [6]
    s.update({x: ModelOutput([6, 8])})  # one draft accepted: 2 positions' KV released
    assert s.blocks.block_table(x) == list(out.block_tables[0][:3])
    rows = []
    while s.has_unfinished():
        out = s.schedule()
        rows += [(rid, out.context_lens[b], out.query_lens[b], out.is_prefill[b])
                 for b, rid in enumerate(out.req_ids) if rid != x]
        s.update({rid: [9] for rid in out.req_ids})
    assert rows[:2] == [(y, 0, 2, True), (z, 0, 2, True)]  # recompute prompt + output, y first
    assert s.output_tokens(y) == [6, 9] and s.output_tokens(x) == [5, 6, 8, 9, 9]


def test_prefix_hits_count_tokens_and_leave_one_to_compute():
    s = sched(block_size=4, max_num_batched_tokens=64)
    p = list(range(12))
    a = s.add_request(p, max_tokens=1)
    s.schedule()
    s.update({a: [3]})
    b = s.add_request(p, max_tokens=1)            # all 12 cached: 8 reused, the last block recomputed
    c = s.add_request(p[:9] + [99], max_tokens=1)  # 2 blocks shared
    out = s.schedule()
    assert out.context_lens == (8, 8) and out.query_lens == (4, 2)
    assert out.block_tables[0][:2] == out.block_tables[1][:2] == tuple(s.blocks.block_table(b)[:2])
    assert s.blocks.refcount(out.block_tables[0][0]) == 2
    assert s.stats.prefix_hit_tokens == 16 and s.stats.prefix_query_tokens == 12 + 12 + 10


def test_speculative_decode_commits_accepted_drafts_and_frees_rejected_kv():
    s = sched(num_blocks=8, block_size=2, max_num_batched_tokens=32, num_speculative_tokens=3)
    a = s.add_request([1, 2, 3], max_tokens=10)
    s.schedule()
    s.update({a: ModelOutput([4], drafts=[5, 6, 7])})
    out = s.schedule()
    assert out.query_lens == (4,) and out.input_ids == ((4, 5, 6, 7),) and out.draft_tokens == ((5, 6, 7),)
    assert out.seq_lens == (7,) and len(out.block_tables[0]) == 4 and out.uniform_decode
    s.update({a: ModelOutput([5, 9], drafts=[1, 1, 1])})  # 1 of 3 accepted, bonus 9
    assert s.output_tokens(a) == [4, 5, 9] and s.requests[a].num_computed == 5
    assert s.blocks.block_table(a) == list(out.block_tables[0][:3])  # the 4th block (position 6, a rejected draft) released
    with pytest.raises(ValueError, match=r"sampled \[2, 3\]; with drafts \[1, 1, 1\] it must get 1 to 4 tokens"):
        s.schedule()
        s.update({a: ModelOutput([2, 3])})


def test_drafts_never_run_past_max_tokens_and_stop_tokens_finish():
    s = sched(num_speculative_tokens=3)
    a = s.add_request([1], max_tokens=3, stop_token_ids=[42])
    s.schedule()
    s.update({a: ModelOutput([2], drafts=[3, 4, 5])})
    out = s.schedule()
    assert out.draft_tokens == ((3,),)  # 2 tokens left: 1 draft + bonus
    assert s.update({a: ModelOutput([3, 8])}) == [a]
    assert s.requests[a].finish_reason == "length" and s.output_tokens(a) == [2, 3, 8]
    b = s.add_request([1], max_tokens=9, stop_token_ids=[42])
    s.schedule()
    s.update({b: [42]})
    assert s.requests[b].finish_reason == "stop" and s.blocks.num_used == 0


def test_abort_frees_and_reports():
    s = sched()
    a = s.add_request([1, 2, 3], max_tokens=5)
    b = s.add_request([4], max_tokens=5)
    s.schedule()
    s.update({a: [1], b: [2]})
    assert s.abort(a) and not s.abort(a) and s.blocks.block_table(a) == []
    out = s.schedule()
    assert out.req_ids == (b,) and out.finished == (a,)
    assert s.abort(b)
    assert s.update({b: [3]}) == [] and s.output_tokens(b) == [2]  # an aborted row's output is dropped
    with pytest.raises(ValueError, match="not a request of this scheduler"):
        s.abort("nope")


def test_argument_errors_are_one_line_and_name_the_field():
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1; got 0"):
        sched(max_num_seqs=0)
    s = sched(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"needs 3 KV blocks at its longest \(9 prompt \+ 2 max_tokens - 1 = 10 "
                                         r"tokens\); the pool has 2"):
        s.add_request(list(range(9)), max_tokens=2)
    with pytest.raises(ValueError, match="non-empty sequence of int"):
        s.add_request([])
    s.add_request([1], req_id="x", max_tokens=2)
    with pytest.raises(ValueError, match="req_id 'x' is already used"):
        s.add_request([1], req_id="x", max_tokens=2)
    s.schedule()
    with pytest.raises(ValueError, match="schedule\\(\\) called twice"):
        s.schedule()
    with pytest.raises(ValueError, match="did not schedule"):
        s.update({"x": [1], "y": [2]})


# ---- property: drawn schedules against the one-request oracle -----------------------------------


@st.composite
def workloads(draw):
    block = draw(st.sampled_from([2, 4, 8, 16]))
    dcp = draw(st.sampled_from([1, 1, 2, 4]))
    inter = draw(st.sampled_from([i for i in (1, 2, 4, 8, 16) if block % i == 0]))
    k = draw(st.sampled_from([0, 1, 3]))
    chunked = draw(st.booleans())
    n = draw(st.integers(1, 6))
    short = st.integers(1, 40)
    reqs = []
    for _ in range(n):
        length = draw(st.one_of(short, short, st.integers(1, 2000)))
        reqs.append(dict(arrival=draw(st.integers(0, 6)), length=length,
                         shared=draw(st.integers(0, length)), max_tokens=draw(st.integers(1, 8)),
                         stop=draw(st.sampled_from([(), (0,), (7, 11)])),
                         abort=draw(st.one_of(st.none(), st.none(), st.integers(0, 30)))))
    bm = BlockManager(1, block, dcp_size=dcp, interleave_size=inter)
    need = max(bm.blocks_for(r["length"] + r["max_tokens"] - 1) for r in reqs)
    num_blocks = need + draw(st.one_of(st.integers(0, 2), st.integers(0, 2 * need)))  # often too few: preemption
    budget = draw(st.one_of(st.integers(16, 64), st.integers(16, 4096)))
    if not chunked:
        budget = max(budget, max(r["length"] + r["max_tokens"] - 1 for r in reqs))
    return dict(block=block, dcp=dcp, inter=inter, k=k, chunked=chunked, reqs=reqs, num_blocks=num_blocks,
                budget=budget, max_num_seqs=draw(st.integers(1, 8)), seed=draw(st.integers(0, 2**16)))


def check_step(s, out, w, fake, admitted):
    bm = s.blocks
    assert out.num_scheduled_tokens <= w["budget"] and len(out.req_ids) <= w["max_num_seqs"]
    assert len(s.running) <= w["max_num_seqs"] and len(set(out.req_ids)) == len(out.req_ids)
    for b, rid in enumerate(out.req_ids):
        seq, row = out.seq_lens[b], out.block_tables[b]
        assert seq == out.context_lens[b] + out.query_lens[b] and out.query_lens[b] > 0
        assert len(row) == bm.blocks_for(seq)
        for r in range(w["dcp"]):  # one shared table covers every rank's share
            assert len(row) >= -(-local_len(seq, w["dcp"], r, w["inter"]) // w["block"])
        if rid in admitted:  # a new context (prefix hit or none): every cached position is this request's
            toks, h = s.requests[rid].tokens, 0
            for p in range(out.context_lens[b]):
                h = chain(h, toks[p])
                assert fake.kv[row[p // bm.span], p % bm.span] == (h, toks[p]), (rid, p)
    holders = {}
    for req in s.requests.values():
        if req.status != "running":
            assert bm.block_table(req.req_id) == []
        for blk in bm.block_table(req.req_id):
            holders[blk] = holders.get(blk, 0) + 1
    for blk, n in holders.items():
        assert bm.refcount(blk) == n and (n == 1 or bm.key_of(blk) is not None)
    assert bm.num_used == len(holders) and bm.num_free + bm.num_used == bm.num_blocks


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_drawn_schedules_match_each_request_run_alone(w):
    rng = random.Random(w["seed"])
    base = [rng.randrange(V) for _ in range(2000)]
    bm = BlockManager(w["num_blocks"], w["block"], dcp_size=w["dcp"], interleave_size=w["inter"])
    s = Scheduler(bm, max_num_batched_tokens=w["budget"], max_num_seqs=w["max_num_seqs"],
                  enable_chunked_prefill=w["chunked"], num_speculative_tokens=w["k"])
    fake = FakeModel(bm.span, w["k"])
    prompts = [base[:r["shared"]] + [rng.randrange(V) for _ in range(r["length"] - r["shared"])] for r in w["reqs"]]
    ids = [None] * len(prompts)
    total = sum(r["length"] + r["max_tokens"] for r in w["reqs"])
    bound = 8 + (len(prompts) + 1) * total
    step = 0
    while step <= 6 or s.has_unfinished():
        for i, r in enumerate(w["reqs"]):
            if r["arrival"] == step:
                ids[i] = s.add_request(prompts[i], max_tokens=r["max_tokens"], stop_token_ids=r["stop"])
            if r["abort"] == step and ids[i] is not None:
                s.abort(ids[i])
        before = {q.req_id for q in s.running}
        out = s.schedule()
        check_step(s, out, w, fake, {rid for rid in out.req_ids if rid not in before})
        s.update(fake.run(out))
        step += 1
        assert step < bound, "a request starved"
    for i, r in enumerate(w["reqs"]):
        req = s.requests[ids[i]]
        want = reference(prompts[i], r["max_tokens"], r["stop"])
        if req.finish_reason == "abort":
            assert req.output == want[:len(req.output)]
        else:
            assert req.output == want, i
    assert bm.num_used == 0 and bm.stats.hit_tokens <= bm.stats.query_tokens
    for name, happened in (("preempted", s.stats.preemptions), ("prefix hit", bm.stats.hit_tokens),
                           ("evicted", bm.stats.evictions), ("uniform decode", s.stats.uniform_decode_steps),
                           ("aborted", any(q.finish_reason == "abort" for q in s.requests.values()))):
        event(f"{name}: {bool(happened)}")
    assert s.stats.steps >= s.stats.uniform_decode_steps


def test_shared_prefixes_under_pressure_hit_and_preempt():
    """A fixed workload where both happen, so the property test's counters are known to move."""
    rng = random.Random(0)
    base = [rng.randrange(V) for _ in range(64)]
    bm = BlockManager(24, 4)
    s = Scheduler(bm, max_num_batched_tokens=32, max_num_seqs=6, num_speculative_tokens=1)
    fake = FakeModel(bm.span, 1)
    prompts = [base[:40 + i] for i in range(6)]
    ids = [s.add_request(p, max_tokens=8) for p in prompts]
    for _ in range(400):
        if not s.has_unfinished():
            break
        s.update(fake.run(s.schedule()))
    assert [s.output_tokens(i) for i in ids] == [reference(p, 8) for p in prompts]
    assert s.stats.prefix_hit_tokens > 0 and s.stats.preemptions > 0 and s.stats.uniform_decode_steps > 0
    assert bm.num_used == 0


def test_docs_worked_example():
    """docs/engine.md's table, step by step."""
    bm = BlockManager(num_blocks=5, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=4)
    s.add_request(list(range(10)), max_tokens=3, req_id="A")
    s.add_request([50, 51, 52], max_tokens=4, req_id="B")
    fresh, seen = iter(range(100, 200)), []
    while s.has_unfinished():
        if len(seen) == 2:
            s.add_request(list(range(9)) + [60], max_tokens=2, req_id="C")
        out = s.schedule()
        seen.append(([f"{r} {c}+{q}" for r, c, q in zip(out.req_ids, out.context_lens, out.query_lens)],
                     dict(zip(out.req_ids, out.block_tables)), out.preempted, out.uniform_decode))
        s.update({r: [next(fresh)] if out.samples[b] else [] for b, r in enumerate(out.req_ids)})
    assert seen == [
        (["A 0+8"], {"A": (0, 1)}, (), False),
        (["A 8+2", "B 0+3"], {"A": (0, 1, 2), "B": (3,)}, (), False),
        (["A 10+1", "B 3+1", "C 8+2"], {"A": (0, 1, 2), "B": (3,), "C": (0, 1, 4)}, (), False),
        (["A 11+1", "B 4+1"], {"A": (0, 1, 2), "B": (3, 4)}, ("C",), True),
        (["B 5+1", "C 8+3"], {"B": (3, 4), "C": (0, 1, 2)}, (), False),
    ]
    st_ = s.stats
    assert (st_.steps, st_.uniform_decode_steps, st_.preemptions, st_.prefix_hit_tokens, st_.prefix_query_tokens,
            st_.blocks_used) == (5, 1, 1, 16, 34, 0)
