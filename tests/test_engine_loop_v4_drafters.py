"""DeepSeek-V4 in the step loop with a drafter reading the target's hidden states (DSpark: the only one V4
takes; MTP is DeepSeek-V3-format's module, Eagle3 fuses [T, H] rows and V4's are [T, n_hc, H] streams).

Target: the random-init float64 tiny V4 of spec_methods_cases.py (sliding, CSA, HCA layers; 2 streams).
Heads: a random DSpark head (fast lane: its drafts are both accepted and rejected on this target, whose
greedy continuations repeat phrases) and the self-distilled one (slow lane: it trains for ~2 s).

Oracles:

- :func:`oracle`: one-device greedy written plainly, each next token the argmax of the last row of a
  one-device full prefill of prompt + tokens so far (no decode cache, no drafts);
- :func:`check_hidden`: every hidden row the drafter was handed (``TargetHidden``: positions
  ``start .. start + valid - 1``) equals the one-device full prefill's hidden state of that position, and
  the rows run up to the history's last computed token (so prompt rows and accepted drafts, nothing rejected);
- ``cpattn.engine.composed.composed`` (the old fixed-batch composition, called explicitly) against
  ``cpattn.engine.generate`` (now the step loop): tokens equal, logits within ``LOGIT_TOL`` (measured: 0.0,
  bit-identical), and the SpecStats counters equal (steps, rows, drafted, accepted, emitted, histogram,
  graph steps; both count a decode step's verified drafts and accepted tokens the same way;
  ``draft_digest`` hashes differently by design, step_generate's docstring).

Layouts: one device, DCP 2, PCP 2 + DCP 2 (one engine); eager and FULL_DECODE_ONLY captured (the "eager"
graph backend: persistent buffers, padding; the hidden rows are outputs of the captured program).
"""

from __future__ import annotations

import functools

import pytest
import torch

from cpattn.comm.sim import SimMesh
from cpattn.config import SchedulerConfig
from cpattn.drafters.dspark import DSparkDrafter
from cpattn.engine import engine_configs, generate
from cpattn.engine.batch import Prompts
from cpattn.engine.composed import composed
from cpattn.engine.driver import step_loop_runs
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.engine.step_generate import refusal
from cpattn.models.family import get_family
from spec_methods_cases import V4_CFG as CFG
from spec_methods_cases import v4_prompts, v4_target, v4_trained

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]  # PCP + DCP in one engine
FAMILY = get_family("deepseek_v4")
LAYOUTS = {"one": (1, 1), "dcp2": (2, 1), "pcp2_dcp2": (2, 2)}  # name: (dcp_size, pcp_size)
MAX_TOKENS = 6
NEW = 8  # generate's tokens per prompt
LOGIT_TOL = 1e-12  # generate (step loop) vs composed, float64: measured 0.0
HIDDEN_TOL = 1e-12  # handed hidden rows vs the one-device full prefill's, float64
# mixed prompt lengths (1 .. 20: shorter and longer than the window 8 and the HCA ratio 16), arriving at steps
ARRIVALS = ((13, 0), (6, 0), (1, 1), (20, 3))


@functools.cache
def random_head() -> DSparkDrafter:
    """A random float64 DSpark head for the target (block 4; fc reads layers 0 and 1's streams)."""
    return DSparkDrafter.random(v4_target(), CFG, block_size=4, mask_token_id=CFG.vocab_size - 1,
                                dtype=torch.float64)


def trained_head() -> DSparkDrafter:
    return v4_trained()[0]


HEADS = {"random": random_head, "trained": trained_head}


def full_prefill(seq, hidden_layers=None):
    """One-device prefill of one whole sequence: ``first_logits`` [1, V], ``hidden`` {name: [S, ...]}."""
    g = SimMesh(1).groups()[0]
    return FAMILY.backend.prefill(g, FAMILY, v4_target(), CFG, Prompts.of([list(seq)], vocab_size=CFG.vocab_size),
                                  hidden_layers=hidden_layers)


@functools.cache
def oracle(prompt: tuple[int, ...], n: int) -> list[int]:
    """n greedy tokens: each the argmax (ties: lowest id) of the last row of a full prefill of all so far."""
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(int(full_prefill(seq).first_logits[0].argmax()))
        seq.append(out[-1])
    return out


@functools.cache
def prefill_hidden(seq: tuple[int, ...], layers: tuple) -> dict:
    """{name: [S, F]} the one-device full prefill's hidden rows of ``seq``, trailing dims flattened."""
    return {n: h.reshape(h.shape[0], -1) for n, h in full_prefill(seq, layers).hidden.items()}


class Recorder:
    """A drafter wrapping ``drafter``; ``log`` holds each proposal's (history, start, valid, {name: [valid, F]}),
    ``states`` the real draft states (to look at their runners)."""

    def __init__(self, drafter):
        self.drafter, self.log, self.states = drafter, [], []
        self.method, self.settings, self.hidden_layers = drafter.method, drafter.settings, drafter.hidden_layers

    def start(self, num_requests, max_len, *, graph=None):
        self.states.append(self.drafter.start(num_requests, max_len, graph=graph))
        return _Recording(self.states[-1], self.log)


class _Recording:
    def __init__(self, state, log):
        self.state, self.log = state, log

    def propose(self, histories, k, requests, hidden=None):
        for i, h in enumerate(histories):
            v = hidden.valid[i]
            self.log.append((tuple(h), hidden.start[i], v, {n: r[i, :v].clone() for n, r in hidden.rows.items()}))
        return self.state.propose(histories, k, requests, hidden)

    def rollback(self, requests, keep_lens):
        self.state.rollback(requests, keep_lens)


def check_hidden(rec: Recorder) -> float:
    """Every handed row is final and the one-device prefill's (module docstring); returns the max abs diff."""
    assert rec.log, "the drafter was never asked"
    worst = 0.0
    for hist, start, valid, rows in rec.log:
        assert start + valid == len(hist) - 1, (len(hist), start, valid)  # up to the last computed token
        assert valid >= 1
        ref = prefill_hidden(hist[:-1], tuple(rec.hidden_layers))
        for name, got in rows.items():
            want = ref[name][start:start + valid]
            assert got.shape == want.shape, (name, got.shape, want.shape)
            worst = max(worst, (got - want).abs().max().item())
    assert worst <= HIDDEN_TOL, worst
    return worst


def engine(layout: str, drafter, k: int, *, graph: bool = False, **kw) -> LLMEngine:
    n, pcp = LAYOUTS[layout]
    sched = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=4, enable_chunked_prefill=False,
                            enable_prefix_caching=False)
    extra = dict(graph_mode="FULL_DECODE_ONLY", graph_backend="eager") if graph else {}
    return LLMEngine("deepseek_v4", v4_target(), CFG, dcp_size=n, pcp_size=pcp, block_size=4, num_blocks=48,
                     scheduler=sched, drafter=drafter, num_speculative_tokens=k, **extra, **kw)


def run_arrivals(eng: LLMEngine, prompts) -> list[list[int]]:
    """Add ``prompts[i]`` at step ``ARRIVALS[i][1]``, step until drained; each request's tokens, in order."""
    ids, step = [], 0
    while len(ids) < len(prompts) or eng.has_unfinished():
        ids += [eng.add_request(p, SamplingParams(max_tokens=MAX_TOKENS))
                for p, (_, at) in zip(prompts, ARRIVALS) if at == step]
        eng.step()
        step += 1
    eng.step()  # the scheduler reports the last finishes with the next step: the runners drop their slots
    assert eng.stats.blocks_used == 0 and [r.live for r in eng.runners] == [0] * len(eng.runners)
    return [list(eng.scheduler.requests[i].output) for i in ids]


def arrival_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, CFG.vocab_size - 1, (n,), generator=g).tolist() for n, _ in ARRIVALS]


def check_arrivals(layout: str, head: str, k: int, graph: bool):
    rec = Recorder(HEADS[head]())
    eng = engine(layout, rec, k, graph=graph)
    prompts = arrival_prompts()
    got = run_arrivals(eng, prompts)
    assert got == [oracle(tuple(p), MAX_TOKENS) for p in prompts]
    s = eng.stats
    assert 0 < s.accepted_tokens < s.drafted_tokens, s  # drafts accepted and rejected: every cut ran
    if graph:
        assert s.replayed_steps > 0 and s.eager_steps > 0, s
    return check_hidden(rec)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_arrivals_equal_one_device_greedy(layout, k):
    """Requests of 13, 6, 1 and 20 tokens arriving at steps 0, 0, 1, 3 (prefills mixed with decodes), a random
    DSpark head reading the streams: one-device greedy's tokens, every handed hidden row the prefill's."""
    check_arrivals(layout, "random", k, graph=False)


@pytest.mark.parametrize("layout,k", [("dcp2", 2), ("pcp2_dcp2", 1)])
def test_arrivals_captured(layout, k):
    """FULL_DECODE_ONLY: uniform decode steps replay the V4 decode program, whose outputs carry the streams."""
    check_arrivals(layout, "random", k, graph=True)


def configs(layout: str, k: int, graph: bool):
    n, pcp = LAYOUTS[layout]
    extra = dict(graph_mode="FULL_DECODE_ONLY", graph_backend="eager") if graph else {}
    return engine_configs("deepseek_v4", CFG, dcp_size=n, pcp_size=pcp, one_engine=pcp > 1, block_size=4,
                          num_speculative_tokens=k, speculative_method="dspark", **extra)


SPEC_FIELDS = ("steps", "rows", "drafted", "accepted", "emitted", "accepted_hist", "graph_steps")


def check_generate(layout: str, head: str, k: int, graph: bool) -> float:
    """generate (the step loop) vs composed (called explicitly) vs the oracle; returns the max logit diff."""
    drafter = Recorder(HEADS[head]())
    pre, dec = configs(layout, k, graph)
    assert refusal(FAMILY, CFG, pre, dec, drafter) is None and step_loop_runs(FAMILY, CFG, pre, dec, drafter)
    prompts = v4_prompts()  # 13, 6, 1, 20 tokens
    got = generate("deepseek_v4", v4_target(), CFG, prompts, NEW, prefill=pre, decode=dec, drafter=drafter)
    want = composed(FAMILY, v4_target(), CFG, Prompts.of(prompts, vocab_size=CFG.vocab_size), NEW, prefill=pre,
                    decode=dec, drafter=drafter.drafter)
    assert got.tokens.tolist() == [oracle(tuple(p), NEW) for p in prompts]
    assert torch.equal(got.tokens, want.tokens)
    diff = (got.logits - want.logits).abs().max().item()
    assert diff <= LOGIT_TOL, diff
    for f in SPEC_FIELDS:
        assert getattr(got.stats, f) == getattr(want.stats, f), (f, got.stats, want.stats)
    s = got.stats
    assert s.drafted == k * s.rows and 0 < s.accepted < s.drafted, s
    check_hidden(drafter)
    if graph:
        assert s.graph_steps == s.steps > 0, s
        # the DSpark block step: the prompts' catch-up eager, then every proposal (after each decode step, the
        # last one's drafts unverified) replays its capture: the proposer hands it 1 + k rows per request
        (state,) = drafter.states
        catch_up = state.runners[1 + k]
        assert catch_up.stats.reasons == {"prefill": 1} and catch_up.stats.graph == s.steps, catch_up.stats
    return diff


@pytest.mark.parametrize("layout,k", [("one", 1), ("one", 2), ("dcp2", 2), ("pcp2_dcp2", 2),
                                      pytest.param("dcp2", 1, marks=pytest.mark.slow),  # k = 1 there: arrivals
                                      pytest.param("pcp2_dcp2", 1, marks=pytest.mark.slow)])
def test_generate_equals_the_composition(layout, k):
    """``cpattn.engine.generate`` of V4 with a DSpark head now runs the step loop: the composition's tokens,
    logits and counters, one-device greedy's tokens."""
    check_generate(layout, "random", k, graph=False)


def test_generate_captured_equals_the_composition():
    check_generate("dcp2", "random", 2, graph=True)


def test_pd_with_a_hidden_state_drafter_runs_the_step_loop():
    """P/D of V4 with a drafter reading hidden states takes the step loop (the V4 connector hands the consumer
    the prompt's hidden rows with the state): tests/test_engine_loop_pd_hidden_v4_hybrid.py checks its drafts,
    tests/test_step_generate.py its generate against the composition."""
    pre, dec = engine_configs("deepseek_v4", CFG, pcp_size=2, dcp_size=2, pd=True, block_size=4,
                              interleave_size=4, num_speculative_tokens=2, speculative_method="dspark")
    assert refusal(FAMILY, CFG, pre, dec, random_head()) is None
    assert step_loop_runs(FAMILY, CFG, pre, dec, random_head())


@pytest.mark.slow  # trains the head (~2 s), then every layout and capture; k = 1: the random head's cases
@pytest.mark.parametrize("k", [2])
def test_trained_head(k):
    """The self-distilled head (most drafts accepted): arrivals and generate vs composition, every layout,
    eager, and captured for DCP 2 and PCP 2 + DCP 2."""
    for layout in LAYOUTS:
        check_arrivals(layout, "trained", k, graph=False)
        check_generate(layout, "trained", k, graph=False)
    for layout in ("dcp2", "pcp2_dcp2"):
        check_arrivals(layout, "trained", k, graph=True)
        check_generate(layout, "trained", k, graph=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout,k", [("one", 1), ("dcp2", 1), ("pcp2_dcp2", 2)])
def test_generate_captured_every_layout(layout, k):
    check_generate(layout, "random", k, graph=True)
