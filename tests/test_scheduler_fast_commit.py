"""The scheduler's fast paths for one-token decode steps (:mod:`cpattn.engine.decode_rows`: the step's
SchedulerOutput, and the commit of ``OneTokenRows``, what the runner hands back for a decode step without
drafts) give exactly the general code's SchedulerOutput and leave exactly its state: the same tokens, computed lengths,
finished requests and reasons, block tables and prefix-cache keys, over drawn schedules with stop tokens,
max_tokens, aborts between schedule and update, prefill chunks, preemptions and drafts (some steps
verify drafts, partly rejected, through the general commit)."""

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
        return Scheduler(BlockManager(rng_blocks, 4, enable_caching=caching), max_num_batched_tokens=12, max_num_seqs=6,
                         num_speculative_tokens=2)
    rng_blocks = rng.choice([6, 10, 40])
    fast, slow = make(), make()
    slow.fast_paths = False  # the general code: _output and update's checked commit
    return rng, fast, slow


@pytest.mark.parametrize("caching", [False, True])
def test_fast_paths_equal_the_general_code(caching):
    runs = [run_pair(seed, caching) for seed in range(16)]
    assert sum(b for b, _ in runs) >= 8 and sum(c for _, c in runs) >= 8  # most reach the fast paths


def run_pair(seed: int, caching: bool) -> tuple[bool, bool]:
    """One drawn schedule on both schedulers; whether decode_rows built any of its steps, and committed any."""
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
        propose = rng.random() < 0.3  # this step proposes drafts (their KV verified, some rejected, next step)
        outs = {}
        for r, t, ok, d in zip(a.req_ids, toks, a.samples, a.draft_tokens):
            kept = list(d[:rng.randrange(len(d) + 1)]) if d else []
            outs[r] = ModelOutput(tuple(kept) + (t,) if ok else (), (5, 6) if propose and ok else ())
        used_fast += one and not propose and bool(a.req_ids)
        got_fast = fast.update(OneTokenRows(a.req_ids, toks) if one and not propose else outs)
        got_slow = slow.update(outs)
        assert got_fast == got_slow
        assert state(fast) == state(slow)
    assert not fast.has_unfinished() and slow._last_decode is None
    return fast._last_decode is not None, used_fast > 0


def test_one_token_rows_of_another_step_go_through_the_checks():
    s = Scheduler(BlockManager(8, 4), max_num_batched_tokens=8, max_num_seqs=4)
    a = s.add_request([1, 2], max_tokens=2)
    s.schedule()
    with pytest.raises(ValueError, match="did not schedule"):
        s.update(OneTokenRows((a, "x"), [5, 6]))
