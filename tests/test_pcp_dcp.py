"""PCP prefill writing the DCP layout directly (same ranks), then DCP decode: exact vs one device.

Opt-in: ``EngineConfig`` with ``allow_pcp_with_dcp=True``; the default refuses, as the guide does.
The reference is plain single-device greedy generation (float64 tiny models, see test_speculative.py);
the KV exchange is also checked row by row against the single-device prefill's KV.
"""

from __future__ import annotations

import pytest
import torch
import spec_pd_cases
from spec_pd_cases import pcp_dcp_cases, prompts, tiny_qwen3

from cpattn.comm.launch import spawn
from cpattn.comm.sim import SimMesh, simulate
from cpattn.config import ConfigError, EngineConfig
from cpattn.engine import driver
from cpattn.engine.batch import Prompts
from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.handoff import exchange
from cpattn.engine.kv_rows import row_width
from cpattn.engine.options import Algorithms
from cpattn.engine.prefill import gather_unshard, prefill
from cpattn.layout.dcp import dcp_owner
from cpattn.models.generate import pcp_dcp_config, pcp_dcp_generate, pcp_dcp_generate_on_rank

NEW = 12


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(one_device):
    """name -> (model, params, cfg, the one-device greedy recompute of NEW tokens) for a tiny model
    (:func:`spec_pd_cases.reference`; conftest.py's ``one_device`` oracle)."""
    return lambda name: spec_pd_cases.reference(one_device, name, NEW)


def _packed():
    ps = prompts()
    cu = [0]
    for q in ps:
        cu.append(cu[-1] + len(q))
    return torch.tensor(sum(ps, [])), cu


CASES = [(1, 1, 4, "a2a"), (2, 1, 4, "a2a"), (2, 4, 4, "allgather"), (4, 2, 4, "a2a"), (4, 1, 2, "allgather"),
         (8, 4, 8, "a2a"), (8, 1, 1, "a2a")]  # (ranks, interleave, block size, exchange)


@pytest.mark.slow
@pytest.mark.parametrize("n,inter,bs,exchange", CASES, ids=[f"N{c[0]}-I{c[1]}-B{c[2]}-{c[3]}" for c in CASES])
def test_matches_single_device(reference, n, inter, bs, exchange):
    model, params, cfg, ref = reference("qwen3")
    config = pcp_dcp_config(model, cfg, n, block_size=bs, interleave_size=inter)
    out = pcp_dcp_generate(model, params, cfg, prompts(), NEW, config=config, exchange=exchange,
                           pcp_method="allgather" if n == 4 else "ring")
    assert torch.equal(out.tokens, ref.tokens)
    assert torch.allclose(out.logits.double(), ref.logits.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mla", "dsa"])
def test_mla_dsa(reference, name):
    model, params, cfg, ref = reference(name)
    out = pcp_dcp_generate(model, params, cfg, prompts(), NEW, config=pcp_dcp_config(model, cfg, 2, interleave_size=2))
    assert torch.equal(out.tokens, ref.tokens)


@pytest.mark.slow
def test_with_speculative_decoding(reference):
    """One engine with PCP speculates with any drafter, exactly (a method outside the guide's list is a
    compatibility note, refused with strict_guide=True: docs/compat.md); a PCP prefill engine and a DCP decode
    engine on the same ranks (the same computation) may use any drafter."""
    model, params, cfg, ref = reference("qwen3")
    out = pcp_dcp_generate(model, params, cfg, prompts(), NEW, config=pcp_dcp_config(model, cfg, 4, interleave_size=2),
                           drafter=NgramDrafter(), num_speculative_tokens=3)
    assert torch.equal(out.tokens, ref.tokens)
    with pytest.raises(ConfigError, match="speculative_method"):
        pcp_dcp_config(model, cfg, 4, interleave_size=2).replace(speculative_method="ngram", num_speculative_tokens=3,
                                                                 strict_guide=True)
    pre, dec = driver.engine_configs(model.FAMILY, cfg, pcp_size=4, dcp_size=4, interleave_size=2,
                                     num_speculative_tokens=3)
    outs = simulate(4, driver.generate_on_rank, model.FAMILY, params, cfg, prompts(), NEW, prefill=pre, decode=dec,
                    drafter=NgramDrafter())
    for out in outs:
        assert torch.equal(out.tokens, ref.tokens)
        assert out.stats.drafted == 3 * out.stats.rows


@pytest.mark.parametrize("exchange_kind", ["a2a", "allgather"])
def test_exchange_delivers_exactly_the_owned_rows(reference, exchange_kind):
    """Each rank receives the KV of exactly the tokens it owns under DCP, equal to one device's prefill KV."""
    model, params, cfg, _ = reference("qwen3")
    tokens, cu = _packed()
    ps = Prompts.of(prompts())
    one = SimMesh(1).groups()[0]
    single = prefill(one, model.FAMILY, params, cfg, ps)
    full = gather_unshard(one, single.rows, single.plan)  # [T, F] one device's rows, request order
    n, inter = 3, 2
    width = row_width(model.FAMILY.kv_layouts(cfg))

    def rank_fn(group):
        out = prefill(group, model.FAMILY, params, cfg, ps)
        return exchange(group, out.rows, out.plan, pcp_size=n, dcp_size=n, interleave_size=inter,
                        width=width, dtype=out.rows.dtype, method=exchange_method)

    exchange_method = exchange_kind
    seen = []
    for r, (got, req, pos, facts) in enumerate(simulate(n, rank_fn)):
        assert (dcp_owner(pos, n, inter) == r).all()
        idx = torch.tensor(cu)[req] + pos  # packed index of each received row
        assert torch.allclose(got, full[idx], rtol=1e-12, atol=1e-12)
        seen.append(idx)
        assert facts.bytes_sent > 0
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(len(tokens)))


def test_a2a_moves_fewer_bytes_than_allgather(reference):
    model, params, cfg, _ = reference("qwen3")
    long = [list(range(1, 60)), list(range(3, 40))]
    sent = {}
    config = pcp_dcp_config(model, cfg, 4, interleave_size=1)
    for ex in ("a2a", "allgather"):  # the fixed-batch composition's hand-off stage (the step loop has none)
        outs = simulate(4, driver.composed_on_rank, model, params, cfg, long, 2, prefill=config, decode=config,
                        algorithms=Algorithms(handoff=ex))
        sent[ex] = sum(o.facts.handoff.bytes_sent for o in outs)
        assert sum(o.facts.handoff.rows_kept for o in outs) + sum(o.facts.handoff.rows_sent for o in outs) == 96
    assert sent["a2a"] * 2 < sent["allgather"]


def test_opt_in_and_config_checks(reference):
    _, _, cfg = tiny_qwen3()
    with pytest.raises(ValueError, match="PCP and DCP cannot both be enabled"):
        EngineConfig.create(tp_size=4, pcp_size=2, dcp_size=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="allow_pcp_with_dcp"):
        pcp_dcp_config("qwen3", cfg, 2, allow_pcp_with_dcp=False)
    assert pcp_dcp_config("qwen3", cfg, 2).parallel.allow_pcp_with_dcp
    model, params, _, _ = reference("qwen3")
    bad = EngineConfig.create(tp_size=4, pcp_size=4, dcp_size=2, num_kv_heads=2, allow_pcp_with_dcp=True)
    with pytest.raises(ValueError, match="same ranks for both"):
        pcp_dcp_generate(model, params, cfg, prompts(), 4, config=bad)


@pytest.mark.slow
def test_on_gloo_ranks(reference):
    """Four real gloo processes: a2a and all-gather exchanges, plain and speculative decode (one spawn)."""
    model, params, cfg, ref = reference("qwen3")
    args = ("qwen3", params, cfg, prompts(), NEW)
    pre, dec = driver.engine_configs("qwen3", cfg, pcp_size=4, dcp_size=4, block_size=2, interleave_size=2,
                                     num_speculative_tokens=2)
    cases = [(pcp_dcp_generate_on_rank, args, {"config": pcp_dcp_config("qwen3", cfg, 4, interleave_size=2),
                                               "exchange": "a2a"}),
             # two engines on the same ranks: PCP prefill engine -> DCP decode engine with a drafter
             (driver.composed_on_rank, args, {"prefill": pre, "decode": dec, "drafter": NgramDrafter(),
                                              "algorithms": Algorithms(dcp_merge="a2a", handoff="allgather")})]
    for per_rank in spawn(4, pcp_dcp_cases, cases):
        for case, out in zip(("step loop", "composition"), per_rank):
            assert torch.equal(out.tokens, ref.tokens), case
            if case == "composition":  # called directly: the fixed-batch composition, its hand-off stage
                assert out.facts.handoff.rows_kept + out.facts.handoff.rows_received > 0
            else:  # the step loop: every KV row to its DCP owner inside the prefill step
                assert out.facts.bytes_sent["prefill"] > 0 and out.facts.kv_bytes > 0
