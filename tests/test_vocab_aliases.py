"""Prompts.prompt_lens is the field; query_lens, its old name, still reads and constructs, with a warning."""

import dataclasses
import pickle

import pytest
import torch

from cpattn.engine.batch import Prompts


def test_prompt_lens_field():
    p = Prompts.of([[5, 6, 7], [8]])
    assert p.prompt_lens == (3, 1) and p.cu_seqlens == [0, 3, 4] and p.num_requests == 2
    assert [f.name for f in dataclasses.fields(Prompts)] == ["tokens", "prompt_lens"]
    assert Prompts(p.tokens, (3, 1)) == p == Prompts(tokens=p.tokens, prompt_lens=(3, 1))
    assert dataclasses.replace(p, prompt_lens=(2, 2)).prompt_lens == (2, 2)
    assert pickle.loads(pickle.dumps(p)).prompt_lens == (3, 1)
    assert p.suffix((2, 0)).prompt_lens == (1, 1)  # the suffix is the prompt a prefill computes


def test_query_lens_deprecated_alias():
    p = Prompts.of([[1, 2, 3], [4, 5]])
    with pytest.warns(DeprecationWarning, match="prompt_lens"):
        assert p.query_lens == (3, 2)
    with pytest.warns(DeprecationWarning, match="prompt_lens"):
        assert Prompts(p.tokens, query_lens=(3, 2)) == p
    with pytest.raises(TypeError, match="prompt_lens only"):
        Prompts(p.tokens, (3, 2), query_lens=(3, 2))
    with pytest.raises(TypeError, match="needs prompt_lens"):
        Prompts(torch.zeros(0, dtype=torch.int64))


def test_pd_sizes_are_pcp_size_and_dcp_size():
    from cpattn.engine.classic import pd_configs
    from cpattn.engine.handoff import deal_blocks, request_blocks
    from cpattn.models import qwen3

    blocks = request_blocks(torch.arange(10.)[:, None], [0, 10], block_size=4)
    want = deal_blocks(blocks, dcp_size=2)
    with pytest.warns(DeprecationWarning, match="pass dcp_size="):
        old = deal_blocks(blocks, decode_size=2)
    assert [[(b, j) for b, j, _ in r] for r in old] == [[(b, j) for b, j, _ in r] for r in want] \
        == [[(0, 0), (0, 1)], [(0, 0)]]
    with pytest.raises(TypeError, match="pass dcp_size= only"):
        deal_blocks(blocks, decode_size=2, dcp_size=2)
    cfg = qwen3.Qwen3Config.tiny()
    new = pd_configs("qwen3", cfg, pcp_size=2, dcp_size=1, block_size=4)
    with pytest.warns(DeprecationWarning, match="pass pcp_size="):
        assert pd_configs("qwen3", cfg, prefill_size=2, dcp_size=1, block_size=4) == new
    assert (new[0].parallel.pcp_size, new[1].parallel.dcp_size) == (2, 1)


def test_on_rank_sizes_replace_the_pcp_dcp_bools():
    from cpattn import simulate
    from cpattn.engine.classic import generate_on_rank
    from cpattn.models import qwen3

    cfg = qwen3.Qwen3Config.tiny()
    params = qwen3.init_params(cfg, seed=0)

    def run(g, **kw):
        return generate_on_rank(g, "qwen3", params, cfg, [[1, 2, 3, 4, 5]], 3, **kw).tokens

    new = simulate(2, run, pcp_size=1)[0]
    with pytest.warns(DeprecationWarning, match="pass pcp_size=2"):
        old = simulate(2, run, pcp=False)[0]
    assert torch.equal(new, old) and torch.equal(new, simulate(2, run)[0])  # PCP over the group: same tokens
    with pytest.raises(RuntimeError, match="pcp_size=3, but a run on every rank of a group of 2"):  # simulate wraps
        simulate(2, run, pcp_size=3)


def test_dsa_cp_size():
    from cpattn.dsa import dsa_cp_plan

    plan = dsa_cp_plan([0, 8], 2)
    assert plan.dsa_cp_size == 2
    with pytest.warns(DeprecationWarning, match="dsa_cp_size"):
        assert plan.cp_size == 2
    with pytest.warns(DeprecationWarning, match="pass dsa_cp_size="):
        old = dsa_cp_plan([0, 8], cp_size=2, split="balanced")
    assert [t.tolist() for t in old.token_index] == [[0, 1, 6, 7], [2, 3, 4, 5]]
