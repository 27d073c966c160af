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
