"""The scheduler's one-token-per-row commit (``OneTokenRows``, what the runner hands back for a decode step
without drafts) leaves exactly the state the general commit leaves: the same tokens, computed lengths,
finished requests and reasons, block tables and prefix-cache keys, over drawn schedules with stop tokens,
max_tokens, aborts between schedule and update, prefill chunks and preemptions."""

import random

import pytest

from cpattn.engine.blocks import BlockManager
from cpattn.engine.scheduler import ModelOutput, Scheduler
from cpattn.engine.step_inputs import OneTokenRows


def state(s: Scheduler):
    reqs = {rid: (tuple(r.tokens), r.num_computed, r.status, r.finish_reason, tuple(r.drafts), tuple(r.keys))
            for rid, r in s.requests.items()}
    return reqs, {rid: s.blocks.table_ids(rid) for rid in s.requests}, s.stats


def pair(seed: int, caching: bool):
    rng = random.Random(seed)
    def make():
        return Scheduler(BlockManager(rng_blocks, 4, enable_caching=caching), max_num_batched_tokens=12, max_num_seqs=6)
    rng_blocks = rng.choice([6, 10, 40])
    return rng, make(), make()


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_one_token_commit_equals_the_general_commit(seed, caching):
    rng, fast, slow = pair(seed, caching)
    for i in range(6):
        prompt = [rng.randrange(1, 9) for _ in range(rng.randrange(1, 14))]
        max_tokens = rng.randrange(1, 8)
        for s in (fast, slow):
            s.add_request(prompt, max_tokens=max_tokens, stop_token_ids=(3,))
    used_fast = 0
    for _ in range(80):
        if not fast.has_unfinished():
            break
        a, b = fast.schedule(), slow.schedule()
        assert a == b
        toks = [rng.randrange(1, 9) for _ in a.req_ids]
        if a.req_ids and rng.random() < 0.15:  # aborted after scheduling, before the update
            victim = rng.choice(a.req_ids)
            fast.abort(victim), slow.abort(victim)
        one = all(a.samples) and not any(a.draft_tokens)
        used_fast += one and bool(a.req_ids)
        got_fast = fast.update(OneTokenRows(a.req_ids, toks) if one else
                               {r: ModelOutput((t,) if ok else ()) for r, t, ok in zip(a.req_ids, toks, a.samples)})
        got_slow = slow.update({r: ModelOutput((t,) if ok else ()) for r, t, ok in zip(a.req_ids, toks, a.samples)})
        assert got_fast == got_slow
        assert state(fast) == state(slow)
    assert not fast.has_unfinished() and used_fast > 0


def test_one_token_rows_of_another_step_go_through_the_checks():
    s = Scheduler(BlockManager(8, 4), max_num_batched_tokens=8, max_num_seqs=4)
    a = s.add_request([1, 2], max_tokens=2)
    s.schedule()
    with pytest.raises(ValueError, match="did not schedule"):
        s.update(OneTokenRows((a, "x"), [5, 6]))
