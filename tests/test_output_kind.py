"""``SamplingParams.output_kind`` (vLLM's RequestOutputKind): a DELTA request's outputs are the tokens new since
its last output, a FINAL_ONLY request's one output is its last, and a CUMULATIVE request's every token so far.

The oracle is a second engine run of the same schedule with every request CUMULATIVE (the kind the rest of the
suite checks token by token against one device): step by step, a DELTA row's output is the cumulative one's
tokens past those returned before (with the logprobs / logits rows of those tokens), a FINAL_ONLY row
returns nothing until the step its cumulative twin finishes, then the same output. Drawn by hypothesis:
arrivals, prompt lengths, token budgets (chunk boundaries), a block pool small enough to preempt, drafts
accepted several at a time, an abort, and every kind mixed in one engine (so the steady decode path runs
with some rows of each kind)."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from cpattn.config import SchedulerConfig
from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine import PDEngine, RequestOutputKind
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.models import qwen3

CFG = qwen3.Qwen3Config.tiny()
PARAMS = qwen3.init_params(CFG)
KINDS = list(RequestOutputKind)


def _engine(budget: int, num_blocks: int, k: int, returns: bool = True) -> LLMEngine:
    """Tiny Qwen3; ``returns``: logits and logprobs kept (then no step takes the steady decode path)."""
    return LLMEngine("qwen3", PARAMS, CFG, block_size=4, num_blocks=num_blocks, seed=0, return_logits=returns,
                     drafter=NgramDrafter() if k else None, num_speculative_tokens=k,
                     scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4))


def _run(reqs, kinds, budget, num_blocks, k, abort_at, returns):
    """Every step's outputs ``{request_id: RequestOutput}`` of one engine, requests added at their steps."""
    eng, steps, ids = _engine(budget, num_blocks, k, returns), [], {}
    while len(ids) < len(reqs) or eng.has_unfinished():
        for i, (at, prompt, n) in enumerate(reqs):
            if at == len(steps) and i not in ids:
                ids[i] = eng.add_request(prompt, SamplingParams(max_tokens=n, logprobs=1 if returns else None, output_kind=kinds[i],
                                                                temperature=0.8 if i % 2 else 0.0, seed=i))
        if abort_at is not None and len(steps) == abort_at[1] and abort_at[0] in ids:
            eng.abort_request(ids[abort_at[0]])
        steps.append({o.request_id: o for o in eng.step()} if eng.has_unfinished() else {})
        assert len(steps) < 400
    assert not eng._token_ids and not eng._kinds  # nothing held once every request is done
    return steps, {rid: kinds[i] for i, rid in ids.items()}


@settings(max_examples=24, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(st.data())
def test_each_kind_is_the_cumulative_run_cut_its_way(data):
    n_req = data.draw(st.integers(2, 5), label="requests")
    reqs = [(data.draw(st.integers(0, 6)), data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=23)),
             data.draw(st.integers(1, 9))) for _ in range(n_req)]
    kinds = [data.draw(st.sampled_from(KINDS)) for _ in range(n_req)]
    budget, k = data.draw(st.sampled_from([8, 16, 64]), label="budget"), data.draw(st.sampled_from([0, 2]))
    num_blocks = data.draw(st.sampled_from([8, 64]), label="blocks")
    abort_at = data.draw(st.none() | st.tuples(st.integers(0, n_req - 1), st.integers(1, 8)))
    returns = data.draw(st.booleans(), label="logits and logprobs")
    cum, _ = _run(reqs, [RequestOutputKind.CUMULATIVE] * n_req, budget, num_blocks, k, abort_at, returns)
    got, kind_of = _run(reqs, kinds, budget, num_blocks, k, abort_at, returns)
    assert len(got) == len(cum)
    sent = {}
    for want, have in zip(cum, got):
        for rid, c in want.items():
            kind = kind_of[rid]
            if kind is RequestOutputKind.CUMULATIVE:
                o = have.pop(rid)
                assert o == c and (o.logits is c.logits is None or torch.equal(o.logits, c.logits))
                continue
            n = sent.get(rid, 0)
            new = c.token_ids[n:]
            if kind is RequestOutputKind.FINAL_ONLY and not c.finished or not new and not c.finished:
                assert rid not in have, (kind, c)
                continue
            o = have.pop(rid)
            keep = c.token_ids if kind is RequestOutputKind.FINAL_ONLY else new
            assert (o.token_ids, o.finished, o.finish_reason, o.prompt_token_ids) == \
                (keep, c.finished, c.finish_reason, c.prompt_token_ids)
            if returns:
                assert o.logprobs == c.logprobs[len(c.token_ids) - len(keep):]
                assert torch.equal(o.logits, c.logits[c.logits.shape[0] - len(keep):])
            else:
                assert o.logprobs is o.logits is None
            sent[rid] = len(c.token_ids)
        assert not have  # no output the cumulative run does not have
    assert set(sent) | {r for r, kd in kind_of.items() if kd is RequestOutputKind.CUMULATIVE} >= \
        {r for s in cum for r, c in s.items() if c.finished}  # every finished request was returned


def test_a_steady_decode_step_builds_nothing_for_final_only_rows(monkeypatch):
    from cpattn.engine import llm, outputs

    steady = []
    monkeypatch.setattr(llm, "one_token_outputs", lambda *a: steady.append(outputs.one_token_outputs(*a)) or steady[-1])
    eng = _engine(64, 64, 0, returns=False)
    ids = [eng.add_request([1 + i, 2, 3], SamplingParams(max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY))
           for i in range(3)]
    d = eng.add_request([7, 8], SamplingParams(max_tokens=6, output_kind=RequestOutputKind.DELTA))
    per_step = []
    while eng.has_unfinished():
        per_step.append([(o.request_id, o.token_ids, o.finished) for o in eng.step()])
    assert [len(s) for s in per_step] == [1] * 5 + [4]  # the DELTA row each step; all four at the end
    assert all(len(toks) == 1 for s in per_step for rid, toks, _ in s if rid == d)
    assert {rid for rid, toks, fin in per_step[-1] if fin and len(toks) == 6} == set(ids)
    assert eng.stats.replayed_steps + eng.stats.eager_steps == 6
    assert [None if s is None else len(s) for s in steady] == [1] * 4  # steps 2-5: the steady path, one object


def test_bad_output_kinds_are_refused_in_one_line():
    with pytest.raises(ValueError, match="output_kind: saw 'delta'; expected a cpattn.engine.RequestOutputKind"):
        SamplingParams(output_kind="delta")
    pd = PDEngine("qwen3", PARAMS, CFG, pcp_size=1, dcp_size=1, block_size=4)
    with pytest.raises(ValueError, match="PDEngine: SamplingParams.output_kind=DELTA: P/D returns CUMULATIVE"):
        pd.add_request([1, 2, 3], SamplingParams(output_kind=RequestOutputKind.DELTA))
