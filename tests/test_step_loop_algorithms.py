"""``Algorithms`` through the step loop (issue 24): ``driver.generate`` / ``generate_on_rank`` and the engines they
build run exactly the algorithms they are given, on the simulated mesh.

For qwen3 (DCP 2; PCP 2 + DCP 2), deepseek_v32 (PCP 2 + DCP 2, both DSA splits), deepseek_v3 (MLA), a P/D
pair and the hybrid (qwen3_next) and DeepSeek-V4 runners: the tokens are one-device greedy's (conftest.py's
``one_device``), and spies show each algorithm was the one used -- the PCP step's method, the DSA split, the
hand-off method of the PCP rows to their DCP owners (``handoff.exchange`` in the runner), the merge of every
DCP step -- and the bytes of a step differ between the two hand-offs. Float64 tiny models, so greedy ties
cannot flip.
"""

from __future__ import annotations

import functools

import pytest
import torch
from engine_loop_cases import tiny_float64

import cpattn
from cpattn.engine import decode as decode_mod
from cpattn.engine import driver, prefill as prefill_mod, runner_pcp
from cpattn.engine.backends import hybrid as hybrid_mod, paged as paged_mod
from cpattn.engine.llm import LLMEngine
from cpattn.engine.options import Algorithms
from cpattn.engine.step_generate import build_engine
from cpattn.models.family import get_family

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
NEW = 3


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 5)]


@pytest.fixture
def seen(monkeypatch):
    """What the run used, recorded from every simulated rank: {"pcp": PCPStep methods, "split": DSA splits,
    "handoff": exchange methods, "merge": DCPStep merges}."""
    got = {"pcp": set(), "split": set(), "handoff": set(), "merge": set()}

    class PCPStep(prefill_mod.PCPStep):  # the paged and the hybrid prefill's
        def __init__(self, *a, method="ring", **kw):
            got["pcp"].add(method)
            super().__init__(*a, method=method, **kw)

    class DCPStep(decode_mod.DCPStep):
        def __post_init__(self):
            got["merge"].add(self.merge)
            super().__post_init__()

    def spy(fn, key, name):
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            got[key].add(kw[name])
            return fn(*a, **kw)
        return wrapped

    for mod in (prefill_mod, hybrid_mod):
        monkeypatch.setattr(mod, "PCPStep", PCPStep)
    monkeypatch.setattr(decode_mod, "DCPStep", DCPStep)
    monkeypatch.setattr(prefill_mod, "dsa_cp_plan", spy(prefill_mod.dsa_cp_plan, "split", "split"))
    for mod in (runner_pcp, paged_mod):  # the paged runner's; the hybrid runner's (backends.paged.handoff)
        monkeypatch.setattr(mod, "exchange", spy(mod.exchange, "handoff", "method"))
    return got


def oracle(one_device, family, params, cfg, ps):
    return one_device(family, params, cfg, ps, NEW).tokens


def ids(a: Algorithms) -> str:
    return f"{a.pcp_method}-{a.handoff}-{a.dcp_merge}"


@pytest.mark.parametrize("algo", [Algorithms(dcp_merge="a2a"), Algorithms(dcp_merge="ag_rs")], ids=ids)
def test_qwen3_dcp(one_device, seen, algo):
    """DCP 2, no PCP: the merge is the algorithms' (no PCP step, no hand-off)."""
    cfg, params = tiny_float64("qwen3", seed=1)
    ps = prompts(cfg.vocab_size)
    pre, dec = driver.engine_configs("qwen3", cfg, dcp_size=2)
    out = driver.generate("qwen3", params, cfg, ps, NEW, prefill=pre, decode=dec, algorithms=algo)
    assert torch.equal(out.tokens, oracle(one_device, "qwen3", params, cfg, ps))
    assert (seen["merge"], seen["pcp"], seen["handoff"]) == ({algo.dcp_merge}, set(), set())


PCP_DCP = [("qwen3", 1, Algorithms(pcp_method="allgather", handoff="allgather", dcp_merge="local_a2a")),
           ("qwen3", 1, Algorithms(pcp_method="ring", handoff="a2a", dcp_merge="local_ag")),
           ("deepseek_v3", 3, Algorithms(pcp_method="allgather", handoff="allgather", dcp_merge="a2a")),  # MLA
           ("deepseek_v3", 3, Algorithms(pcp_method="ring", dcp_merge="ag_rs"))]


@pytest.mark.parametrize("family,seed,algo", PCP_DCP, ids=lambda v: ids(v) if isinstance(v, Algorithms) else str(v))
def test_pcp_dcp(one_device, seen, family, seed, algo):
    cfg, params = tiny_float64(family, seed=seed)
    ps = prompts(cfg.vocab_size)
    pre, dec = driver.engine_configs(family, cfg, pcp_size=2, dcp_size=2)
    out = driver.generate(family, params, cfg, ps, NEW, prefill=pre, decode=dec, algorithms=algo)
    assert torch.equal(out.tokens, oracle(one_device, family, params, cfg, ps))
    assert (seen["pcp"], seen["handoff"], seen["merge"]) == ({algo.pcp_method}, {algo.handoff}, {algo.dcp_merge})


def test_handoff_bytes_differ(one_device):
    """PCP 2 + DCP 2 on a simulated world through generate_on_rank: the all-gather hand-off of the prefill
    step's rows sends more than the all-to-all (each rank gets every row, keeps its own)."""
    cfg, params = tiny_float64("qwen3", seed=1)
    ps = [list(range(1, 30)), list(range(3, 20))]
    pre, dec = driver.engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2)
    sent = {}
    for h in ("a2a", "allgather"):
        outs = cpattn.simulate(2, driver.generate_on_rank, "qwen3", params, cfg, ps, 2, prefill=pre, decode=dec,
                               algorithms=Algorithms(handoff=h))
        assert all(torch.equal(o.tokens, oracle(one_device, "qwen3", params, cfg, ps)[:, :2]) for o in outs)
        assert all(o.facts.handoff.bytes_sent == 0 for o in outs)  # the step loop: no hand-off stage
        sent[h] = sum(o.facts.bytes_sent["prefill"] for o in outs)
    assert sent["a2a"] < sent["allgather"]


@pytest.mark.parametrize("split", ["balanced", "contiguous"])
def test_deepseek_v32(one_device, seen, split):
    cfg, params = tiny_float64("deepseek_v32", seed=2)
    ps = prompts(cfg.vocab_size)
    algo = Algorithms(dsa_split=split, handoff="allgather" if split == "balanced" else "a2a")
    pre, dec = driver.engine_configs("deepseek_v32", cfg, pcp_size=2, dcp_size=2)
    out = driver.generate("deepseek_v32", params, cfg, ps, NEW, prefill=pre, decode=dec, algorithms=algo)
    assert torch.equal(out.tokens, oracle(one_device, "deepseek_v32", params, cfg, ps))
    assert (seen["split"], seen["handoff"]) == ({split}, {algo.handoff})
    assert seen["pcp"] == set()  # a DSA chunk runs DSA-CP, which has no pcp_method


def test_pd_pair(one_device, seen):
    """P/D (producer PCP 2 -> consumer DCP 2) through generate_on_rank on a world of 4: both engines run them."""
    cfg, params = tiny_float64("qwen3", seed=1)
    ps = prompts(cfg.vocab_size)
    algo = Algorithms(pcp_method="allgather", handoff="allgather", dcp_merge="ag_rs")
    pre, dec = driver.engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2, pd=True, block_size=4, interleave_size=4)
    outs = cpattn.simulate(4, driver.generate_on_rank, "qwen3", params, cfg, ps, NEW, prefill=pre, decode=dec,
                           algorithms=algo)
    want = oracle(one_device, "qwen3", params, cfg, ps)
    assert [o.facts.role for o in outs] == ["prefill"] * 2 + ["decode"] * 2
    assert all(torch.equal(o.tokens, want) for o in outs)
    assert (seen["pcp"], seen["handoff"]) == ({"allgather"}, {"allgather"})
    assert seen["merge"] == {"ag_rs"}  # the consumer's decode steps (and the producer's, had it any)


def test_engine_argument():
    """LLMEngine(algorithms=): exactly those on every runner (no "auto" pcp choice), the merge theirs; a merge=
    that disagrees is refused; None keeps the runners' own choice."""
    cfg, params = tiny_float64("qwen3", seed=1)
    algo = Algorithms(pcp_method="ring", dcp_merge="a2a", handoff="allgather")
    eng = LLMEngine("qwen3", params, cfg, dcp_size=2, pcp_size=2, block_size=4, num_blocks=8, algorithms=algo)
    assert eng.algorithms is algo
    for r in eng.runners:
        assert r.algorithms is algo and not r._auto_pcp and r._step.keywords["merge"] == "a2a"
    same = LLMEngine("qwen3", params, cfg, dcp_size=2, block_size=4, num_blocks=8, merge="a2a", algorithms=algo)
    assert same.runners[0]._step.keywords["merge"] == "a2a"
    with pytest.raises(ValueError, match="disagrees with algorithms.dcp_merge"):
        LLMEngine("qwen3", params, cfg, dcp_size=2, block_size=4, num_blocks=8, merge="ag_rs", algorithms=algo)
    auto = LLMEngine("qwen3", params, cfg, dcp_size=2, pcp_size=2, block_size=4, num_blocks=8, merge="ag_rs")
    assert auto.algorithms is None and auto.runners[0]._auto_pcp and auto.runners[0]._step.keywords["merge"] == "ag_rs"


def test_hybrid(one_device, seen):
    """qwen3_next PCP 2 + DCP 2: its attention layers' PCP method, hand-off and DCP merge are the algorithms'."""
    cfg, params = tiny_float64("qwen3_next", seed=1)
    ps = prompts(cfg.vocab_size)
    algo = Algorithms(pcp_method="allgather", handoff="allgather", dcp_merge="a2a")
    pre, dec = driver.engine_configs("qwen3_next", cfg, pcp_size=2, dcp_size=2)
    out = driver.generate("qwen3_next", params, cfg, ps, NEW, prefill=pre, decode=dec, algorithms=algo)
    assert torch.equal(out.tokens, oracle(one_device, "qwen3_next", params, cfg, ps))
    assert (seen["pcp"], seen["handoff"], seen["merge"]) == ({"allgather"}, {"allgather"}, {"a2a"})


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v4"])
def test_pd_runners_hold_them(family):
    """build_engine hands a P/D pair's algorithms to both roles' runners (hybrid, V4: V4's docstring says a V4
    run is the same whatever they are)."""
    cfg, params = tiny_float64(family, seed=1)
    algo = Algorithms(pcp_method="allgather", handoff="allgather", dcp_merge="a2a")
    pre, dec = driver.engine_configs(family, cfg, pcp_size=2, dcp_size=2, pd=True, block_size=4, interleave_size=4)
    eng = build_engine(get_family(family), params, cfg, [9, 5], NEW, prefill=pre, decode=dec, algorithms=algo)
    try:
        assert all(r.algorithms is algo for e in (eng.prefill, eng.decode) for r in e.runners)
    finally:
        eng.close()


def test_v4_tokens(one_device):
    """DeepSeek-V4 PCP 2 + DCP 2 under non-default algorithms: one-device tokens (nothing in a V4 run uses them)."""
    cfg, params = tiny_float64("deepseek_v4", seed=1)
    ps = prompts(cfg.vocab_size)
    pre, dec = driver.engine_configs("deepseek_v4", cfg, pcp_size=2, dcp_size=2)
    out = driver.generate("deepseek_v4", params, cfg, ps, NEW, prefill=pre, decode=dec,
                          algorithms=Algorithms(pcp_method="allgather", handoff="allgather", dcp_merge="a2a"))
    assert torch.equal(out.tokens, oracle(one_device, "deepseek_v4", params, cfg, ps))


@pytest.mark.slow
def test_on_gloo_ranks(one_device):
    """Two gloo processes, one engine PCP 2 + DCP 2 with non-default algorithms: one-device tokens."""
    from cpattn.comm.launch import spawn

    cfg, params = tiny_float64("qwen3", seed=1)
    ps = prompts(cfg.vocab_size)
    pre, dec = driver.engine_configs("qwen3", cfg, pcp_size=2, dcp_size=2)
    outs = spawn(2, driver.generate_on_rank, "qwen3", params, cfg, ps, NEW, prefill=pre, decode=dec,
                 algorithms=Algorithms(pcp_method="allgather", handoff="allgather", dcp_merge="ag_rs"))
    want = oracle(one_device, "qwen3", params, cfg, ps)
    assert all(torch.equal(o.tokens, want) for o in outs)
