"""Speculative decoding on hybrid models (Qwen3-Next) with its MTP module, and drafts in the fixed-batch path.

Oracles: one-device greedy generation without drafts (conftest.py's ``one_device``, :mod:`ref.greedy`: each
token the argmax of a fresh full one-device prefill's last row, no engine code), float64 weights of
tests/test_engine_loop_hybrid.py's model; for acceptance, an *identity-like* MTP head whose every draft is known from the greedy tokens alone:
``fc = [0 | I]`` (the embedding ignored), attention and MLP outputs zeroed, norms at their identity, so
``hn = h_p`` (the target's final-normed state, rms 1 here) and its draft is the target's own choice at p,
``t_{p+1}``: each step drafts the last token k times. A step after n emitted tokens then accepts the leading
repeats of ``g[n-1]`` in ``g[n:n+k]`` -- counted from the greedy tokens in :func:`repeat_acceptance`; a hidden
row fed from the wrong position, or missing, changes that count. For the MTP layer itself (which transformers
5.24 does not implement: it ignores ``mtp.*``) a float64 recomputation with a dense causal mask over every row
checks the drafter's cached catch-up-and-chain; a random head checks losslessness with rejected drafts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine_loop_hybrid import LAYOUTS, engine, model, prompt, sched

from cpattn.drafters.qwen3_next_mtp import Qwen3NextMTPDrafter, as_layer, block_config, mtp_logits_features
from cpattn.engine import engine_configs, generate
from cpattn.drafters.ngram import NgramDrafter
from cpattn.engine.drafters import TargetHidden
from cpattn.engine.llm import LLMEngine, SamplingParams
from cpattn.models import qwen3_next as qn

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")]
TOKENS = 12


def greedy(one_device, prompt_: tuple[int, ...], n: int = TOKENS + 4) -> list[int]:
    """One device, no drafts (a few tokens past TOKENS: a last step's accepted drafts may reach them);
    conftest.py's ``one_device``: each token the argmax of a fresh full prefill's last row."""
    cfg, params = model()
    return one_device.tokens("qwen3_next", params, cfg, list(prompt_), n)


def prompts() -> list[list[int]]:
    """Seeds whose greedy continuations repeat a token within the first TOKENS (101: 43 43, 102: 38 38,
    105: 47 47), so the identity head gets drafts accepted."""
    return [prompt(6, 101), prompt(6, 102), prompt(6, 105)]


def identity_head() -> Qwen3NextMTPDrafter:
    cfg, params = model()
    d = Qwen3NextMTPDrafter.random(cfg, params, seed=5)
    p, hs = dict(d.params), cfg.hidden_size
    p["mtp.fc.weight"] = torch.cat([torch.zeros(hs, hs), torch.eye(hs)], 1).to(torch.float64)
    for name in list(p):  # the layer's outputs: attention, experts and shared expert projections back to H
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            p[name] = torch.zeros_like(p[name])
    return Qwen3NextMTPDrafter("qwen3_next", p, cfg)


def repeat_acceptance(g: list[int], tokens: int, k: int) -> int:
    """Accepted drafts of the identity head over a fixed-batch run of ``tokens`` tokens (first from the
    prefill, then steps of k drafts, all equal to the last token)."""
    n, acc = 1, 0
    while n < tokens:
        a = 0
        while a < k and g[n + a] == g[n - 1]:
            a += 1
        acc, n = acc + a, n + a + 1
    return acc


def fixed(reqs, k, drafter, *, pcp=1, dcp=1, **kw):
    cfg, params = model()
    pre, dec = engine_configs("qwen3_next", cfg, pcp_size=pcp, dcp_size=dcp, num_speculative_tokens=k,
                              speculative_method=drafter.method, **kw)
    return generate("qwen3_next", params, cfg, reqs, TOKENS, prefill=pre, decode=dec, drafter=drafter,
                    prompt_logits=False)


@pytest.mark.parametrize(("pcp", "dcp", "k", "graph"), [(1, 1, 1, "NONE"), (1, 1, 3, "NONE"), (2, 2, 2, "NONE"),
                                                    (3, 1, 2, "NONE"), (1, 2, 2, "FULL_DECODE_ONLY")])
def test_fixed_batch_identity_mtp_is_lossless_and_accepts_the_repeats(one_device, pcp, dcp, k, graph):
    reqs = prompts()
    out = fixed(reqs, k, identity_head(), pcp=pcp, dcp=dcp, graph_mode=graph, graph_backend="eager")
    want = [greedy(one_device, tuple(p)) for p in reqs]
    assert out.tokens.tolist() == [w[:TOKENS] for w in want]
    expected = sum(repeat_acceptance(w, TOKENS, k) for w in want)
    assert out.stats.accepted == expected > 0, (out.stats.accepted, expected)
    assert (out.stats.graph_steps > 0) == (graph != "NONE"), out.stats


@pytest.mark.parametrize(("dcp", "k", "graph"), [(1, 2, "NONE"), (2, 3, "NONE"), (2, 2, "FULL_DECODE_ONLY")])
def test_fixed_batch_ngram_drafts_are_lossless(one_device, dcp, k, graph):
    """The fixed-batch hybrid path with drafts (was refused): n-gram drafts over prompts that repeat themselves,
    some accepted and some rejected (a committed rejected state would turn the next tokens wrong)."""
    reqs = [prompt(6, 103) + greedy(one_device, tuple(prompt(6, 103)))[:8], prompt(4, 201) * 4]
    out = fixed(reqs, k, NgramDrafter(), dcp=dcp, graph_mode=graph, graph_backend="eager")
    assert out.tokens.tolist() == [greedy(one_device, tuple(p))[:TOKENS] for p in reqs]
    assert out.stats.drafted > out.stats.accepted > 0, out.stats
    if graph != "NONE":
        assert out.stats.graph_steps > 0, out.stats


def test_fixed_batch_random_mtp_is_lossless(one_device):
    cfg, params = model()
    reqs = prompts()
    out = fixed(reqs, 2, Qwen3NextMTPDrafter.random(cfg, params, seed=2, std=0.2), dcp=2)
    assert out.tokens.tolist() == [greedy(one_device, tuple(p))[:TOKENS] for p in reqs]
    assert out.stats.drafted > out.stats.accepted, out.stats


def run(eng, reqs) -> list[list[int]]:
    ids = [eng.add_request(p, SamplingParams(max_tokens=TOKENS)) for p in reqs]
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.blocks_used == 0
    return [list(eng.scheduler.requests[i].output) for i in ids]


@pytest.mark.parametrize(("layout", "k"), [("one", 1), ("one", 3), ("dcp2", 2), ("pcp2_dcp2", 2)])
def test_step_loop_identity_mtp_is_lossless_and_accepts(one_device, layout, k):
    """The step loop (chunked prefill: the prompt's hidden rows arrive over several steps, under PCP too)."""
    reqs = prompts()
    eng = engine(layout, num_blocks=64 // LAYOUTS[layout][0], drafter=identity_head(), num_speculative_tokens=k,
                 scheduler=sched(max_num_batched_tokens=8))
    got = run(eng, reqs)
    want = [greedy(one_device, tuple(p)) for p in reqs]
    assert got == [w[:TOKENS] for w in want]
    # the scheduler may cut drafts (budget, max_tokens): at most the uncut count, and some accepted
    bound = sum(repeat_acceptance(w, TOKENS, k) for w in want)
    assert 0 < eng.stats.accepted_tokens <= bound, (eng.stats.accepted_tokens, bound)


def test_step_loop_random_mtp_captured_decode_is_lossless(one_device):
    cfg, params = model()
    reqs = prompts()
    eng = engine("one", num_blocks=64, drafter=Qwen3NextMTPDrafter.random(cfg, params, seed=2, std=0.2),
                 num_speculative_tokens=2, graph_mode="FULL_DECODE_ONLY", graph_backend="eager")
    assert run(eng, reqs) == [greedy(one_device, tuple(p))[:TOKENS] for p in reqs]
    assert eng.stats.replayed_steps > 0, eng.stats


def dense_attend(q, k, v, scale):
    """Softmax attention with a dense causal mask written out (row n sees rows 0 .. n): q [N, Hq, hd],
    k / v [N, Hkv, hd] -> [N, Hq, hd]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    n = q.shape[0]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hnm,mhd->nhd", s.softmax(-1), v)


def test_mtp_layer_catch_up_and_chain_equal_a_dense_recomputation():
    """The drafter's cached rows (the prompt's catch-up, then a chain of 3) against the layer recomputed over
    every row with an explicit causal mask: the first draft and the chained ones (each fed the previous
    depth's feature) are the dense argmax."""
    cfg, params = model()
    d = Qwen3NextMTPDrafter.random(cfg, params, seed=4, std=0.3)
    hist = [5, 9, 2, 7, 11, 3]
    h = torch.randn(len(hist) - 1, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    state = d.start(num_requests=2, max_len=16)
    drafts = state.propose([hist], 3, [1], TargetHidden({"norm": h[None]}, (0,), (len(hist) - 1,)))[0].tolist()
    tokens, feats, pos = hist[1:], h, list(range(len(hist) - 1))
    want = []
    for _ in range(3):  # each depth: the dense layer over every row so far, its last row's argmax and feature
        logits, hn = mtp_logits_features(as_layer(d.params, cfg.num_hidden_layers), block_config(cfg),
                                         torch.tensor(tokens), feats, torch.tensor(pos), dense_attend)
        nxt = int(logits[-1].argmax())
        want.append(nxt)
        tokens, feats, pos = tokens + [nxt], torch.cat([feats, hn[-1:]]), pos + [pos[-1] + 1]
    assert drafts == want


def test_from_checkpoint_reads_the_mtp_tensors(tmp_path):
    """A checkpoint with Qwen3-Next's names (``mtp.*`` with per-expert MLPs, the target's embedding and head)
    loads back to the same drafter; one without ``mtp.*`` is refused in one line."""
    from cpattn.drafters import checkpoint

    cfg, params = model()
    d = Qwen3NextMTPDrafter.random(cfg, params, seed=3)
    config = {"model_type": "qwen3_next", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "head_dim": cfg.head_dim, "layer_types": list(cfg.layer_types),
              "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
              "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
              "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
              "moe_intermediate_size": cfg.moe_intermediate_size, "mlp_only_layers": [2],
              "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size, "mtp_num_hidden_layers": 1}
    checkpoint.save(tmp_path / "full", checkpoint.unstack_experts(d.params), config)
    back = Qwen3NextMTPDrafter.from_checkpoint(tmp_path / "full")
    assert back.model == "qwen3_next" and back.cfg == cfg
    assert sorted(back.params) == sorted(d.params)
    assert all(torch.equal(back.params[n], d.params[n]) for n in d.params)
    from cpattn.drafters.registry import DRAFTERS

    routed = DRAFTERS["mtp"].from_checkpoint(tmp_path / "full")  # the registry's "mtp" reads a hybrid checkpoint
    assert isinstance(routed, Qwen3NextMTPDrafter) and sorted(routed.params) == sorted(d.params)
    no_mtp = {n: t for n, t in d.params.items() if not n.startswith("mtp.")}
    checkpoint.save(tmp_path / "bare", no_mtp, config)
    with pytest.raises(ValueError, match="no mtp") as e:
        Qwen3NextMTPDrafter.from_checkpoint(tmp_path / "bare")
    assert "\n" not in str(e.value)


def test_forward_hidden_states_are_the_final_normed_rows():
    """``forward(..., hidden_layers=())``: hidden["norm"] projects to the same logits (what the MTP reads)."""
    from cpattn.engine.dense_cache import DenseKVCache
    from cpattn.models.common import lm_head

    cfg, params = model()
    toks = torch.tensor(prompt(7, 9))
    mk = lambda: (DenseKVCache.empty(qn.kv_layouts(cfg), batch=1, max_len=8, dtype=torch.float64).step([7]),  # noqa
                  qn.recurrent_cache(cfg, batch=1, dtype=torch.float64).step([7]))
    plain = qn.forward(params, cfg, toks, *mk())
    logits, hidden = qn.forward(params, cfg, toks, *mk(), hidden_layers=(1,))
    assert torch.equal(logits, plain) and sorted(hidden, key=str) == [1, "norm"]
    torch.testing.assert_close(torch.nn.functional.linear(hidden["norm"], lm_head(params, cfg)), plain)


def test_qwen3_5_mtp_in_the_step_loop_is_lossless(one_device):
    """Qwen3.5 (split projections, dense MLPs: the MTP layer's MLP is dense too) on DCP 2."""
    from test_engine_loop_hybrid import reference

    cfg, params = model("qwen3_5")
    d = Qwen3NextMTPDrafter.random(cfg, params, model="qwen3_5", seed=1, std=0.2)
    assert "mtp.layers.0.mlp.gate_proj.weight" in d.params and "mtp.layers.0.mlp.gate.weight" not in d.params
    reqs = [prompt(9, 31), prompt(5, 32)]
    eng = engine("dcp2", num_blocks=32, family="qwen3_5", drafter=d, num_speculative_tokens=2)
    ids = [eng.add_request(p, SamplingParams(max_tokens=6)) for p in reqs]
    while eng.has_unfinished():
        eng.step()
    want = [reference(one_device, tuple(p), "qwen3_5") for p in reqs]
    assert [list(eng.scheduler.requests[i].output) for i in ids] == want
    assert eng.stats.drafted_tokens > 0


@pytest.mark.slow  # builds and saves a transformers model (~7 s on 2 shared cores)
def test_from_checkpoint_reads_the_composite_qwen3_5_form(tmp_path):
    """The Hub's Qwen3.5 form (``save_pretrained`` of ``Qwen3_5ForConditionalGeneration``: a nested
    ``text_config``, the text weights under ``model.language_model.``, a vision tower) with ``mtp.*`` beside it
    in its own safetensors file: the module loads with the language model's embedding and head."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    text = dict(vocab_size=64, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=3,
                num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12,
                linear_num_key_heads=1, linear_num_value_heads=3, layer_types=["linear_attention", "full_attention"],
                eos_token_id=None, bos_token_id=None, pad_token_id=None)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                  vision_config=vision))
    hf.save_pretrained(tmp_path)
    cfg = qn.Qwen3NextConfig.from_hf(hf.config.to_dict())
    target = qn.load_params(hf.state_dict())
    d = Qwen3NextMTPDrafter.random(cfg, target, model="qwen3_5", seed=7)
    save_file({n: t.contiguous() for n, t in d.params.items() if n.startswith("mtp.")},
              str(tmp_path / "mtp.safetensors"))
    back = Qwen3NextMTPDrafter.from_checkpoint(tmp_path)
    assert back.model == "qwen3_5" and dataclasses.asdict(back.cfg) == dataclasses.asdict(cfg)
    assert sorted(back.params) == sorted(d.params)
    assert all(torch.equal(back.params[n], d.params[n]) for n in d.params)


@pytest.mark.slow  # ~1 s: slow lane; the lossless MTP cases above stay fast
def test_step_loop_mtp_with_preemption(one_device):
    """A pool too small for every request: a preempted request recomputes and its hidden rows start over."""
    reqs = prompts()
    eng = engine("dcp2", num_blocks=5, drafter=identity_head(), num_speculative_tokens=2)
    assert run(eng, reqs) == [greedy(one_device, tuple(p))[:TOKENS] for p in reqs]
    assert eng.stats.preemptions > 0 and eng.stats.accepted_tokens > 0, eng.stats


@pytest.mark.slow  # ~1 s: slow lane; the lossless MTP cases above stay fast
def test_step_loop_mtp_with_seeded_sampling(one_device):
    """temperature > 0: the tokens do not depend on the drafts (as without a drafter)."""
    reqs = prompts()

    def sampled(eng):
        ids = [eng.add_request(p, SamplingParams(max_tokens=TOKENS, temperature=0.3, seed=7 + i))
               for i, p in enumerate(reqs)]
        while eng.has_unfinished():
            eng.step()
        return [list(eng.scheduler.requests[i].output) for i in ids]

    plain = sampled(engine("one", num_blocks=64))
    assert plain != [greedy(one_device, tuple(p))[:TOKENS] for p in reqs]  # not greedy
    eng = engine("dcp2", num_blocks=32, drafter=identity_head(), num_speculative_tokens=2)
    assert sampled(eng) == plain and eng.stats.drafted_tokens > 0


def gloo_mtp_rank(group) -> tuple[list[list[int]], int]:
    """One real rank of PCP 2 + DCP 2 with the identity MTP head: (tokens per request, accepted drafts)."""
    cfg, params = model()
    eng = LLMEngine("qwen3_next", params, cfg, world=group, dcp_size=group.size, pcp_size=group.size, block_size=4,
                    num_blocks=32, scheduler=sched(max_num_batched_tokens=8), drafter=identity_head(),
                    num_speculative_tokens=2)
    return run(eng, prompts()), eng.stats.accepted_tokens


@pytest.mark.slow
def test_gloo_ranks_with_mtp_give_the_simulated_run(one_device):
    """Under real processes every rank drafts from its own copy of the hidden states: the same tokens and the
    same accepted count as the simulated run, and the greedy tokens."""
    from cpattn.comm.launch import spawn

    per_rank = spawn(2, gloo_mtp_rank)
    eng = engine("pcp2_dcp2", num_blocks=32, drafter=identity_head(), num_speculative_tokens=2,
                 scheduler=sched(max_num_batched_tokens=8))
    sim = run(eng, prompts()), eng.stats.accepted_tokens
    assert per_rank[0] == per_rank[1] == sim
    assert sim[0] == [greedy(one_device, tuple(p))[:TOKENS] for p in prompts()] and sim[1] > 0
