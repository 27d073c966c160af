"""Every RequestOutput the step loop hands back holds the request's output tokens so far -- the scheduler's
``tokens[num_prompt:]`` at that step (the engine extends the tuple it returned last time instead of copying
the history) -- through arrivals, decode steps of one token per row, drafts accepted several at a time,
preemptions, a stop token and an abort."""

import pytest

from cpattn.config import SchedulerConfig
from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.models import qwen3


@pytest.mark.parametrize("k", [0, 2])
def test_each_steps_token_ids_are_the_outputs_so_far(k):
    cfg = qwen3.Qwen3Config.tiny()
    eng = LLMEngine("qwen3", qwen3.init_params(cfg), cfg, block_size=4, num_blocks=8, seed=0,
                    drafter=NgramDrafter() if k else None, num_speculative_tokens=k,
                    scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7], [9] * 11, [4, 4, 8, 4, 4, 8]]
    ids = [eng.add_request(p, SamplingParams(max_tokens=12, temperature=0.9 if i == 0 else 0.0, seed=i))
           for i, p in enumerate(prompts[:3])]
    seen, finished, lengths = 0, {}, set()
    while eng.has_unfinished():
        if eng.stats.steps == 3:
            ids.append(eng.add_request(prompts[3], SamplingParams(max_tokens=5)))
        if eng.stats.steps == 6:
            assert eng.abort_request(ids[1]) and ids[1] not in eng._token_ids
        for o in eng.step():
            req = eng.scheduler.requests[o.request_id]
            assert o.token_ids == tuple(req.output) and type(o.token_ids) is tuple
            assert o.prompt_token_ids == tuple(prompts[ids.index(o.request_id)])
            lengths.add(len(o.token_ids))
            seen += 1
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert seen and ids[1] not in finished and len(finished) == 3 and len(lengths) > 5
    assert eng.stats.accepted_tokens > 0 or not k  # some steps commit several tokens of a row
    assert eng.stats.preemptions > 0 and not eng._token_ids  # nothing held once every request finished
