"""The cache-backend seam (cpattn.engine.backend): families declare a kind, the engine calls its backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpattn.engine.backend import CACHE_KINDS, CacheBackend, DecodeProgram, backend_for
from cpattn.engine.backends.paged import PAGED, PagedProgram
from cpattn.engine.backends.v4 import V4Backend
from cpattn.engine.family import FAMILY_MODULES, get_family
from cpattn.engine.paged_cache import PagedShard


@pytest.mark.parametrize("name", sorted(FAMILY_MODULES))
def test_every_family_declares_a_kind_with_a_backend(name):
    fam = get_family(name)
    assert fam.cache in CACHE_KINDS
    backend = fam.backend
    assert isinstance(backend, CacheBackend) and backend.name == fam.cache
    assert backend.per_token_kv == (fam.cache == "paged")
    assert (fam.cache == "v4") == (name == "deepseek_v4")


def test_an_unknown_kind_is_refused_in_one_line():
    fam = get_family("qwen3")
    with pytest.raises(ValueError,
                       match=r"cache='dense' is not a cache kind; expected one of \('paged', 'v4', 'hybrid'\)"):
        dataclasses.replace(fam, cache="dense")


def test_v4_declared_by_name_or_by_legacy_stages():
    v4 = get_family("deepseek_v4")
    by_name = dataclasses.replace(v4, stages=None, cache="v4")
    assert isinstance(backend_for(by_name), V4Backend) and backend_for(by_name).stages.forward is v4.forward
    legacy = dataclasses.replace(v4, cache="paged")  # stages= alone: the deprecated declaration
    assert legacy.cache == "v4" and backend_for(legacy).stages is v4.stages


def test_paged_program_plans_what_the_step_reads():
    from cpattn.models import qwen3

    cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    fam = get_family("qwen3")
    shard = PagedShard.empty(fam.kv_layouts(cfg), capacity=[8, 12], dcp_size=1, block_size=4, interleave_size=1)
    from cpattn.comm.sim import SimMesh

    prog = PAGED.program(SimMesh(1).groups()[0], fam, qwen3.init_params(cfg), cfg, shard)
    assert isinstance(prog, PagedProgram) and isinstance(prog, DecodeProgram)
    batch = prog.batch([1, 0], [5, 2], torch.arange(6))  # q = 3 rows per request
    assert batch["seq_lens"].tolist() == [8, 5]
    assert torch.equal(batch["block_table"], shard.block_table[[1, 0]])
    assert set(prog.fields) >= {"tokens", "seq_lens", "block_table"}
