"""Qwen3-Next through the engine (the "hybrid" cache kind) against transformers' Qwen3NextForCausalLM.

A tiny seeded HF model in float64 (6 query heads / 1 KV head, linear heads 1 key / 3 value, the pattern
linear, full, linear, linear, full, MoE with a shared expert) is the oracle; cpattn runs the same weights
through :func:`cpattn.engine.generate`: head-tail PCP prefill (the attention layers by ring attention, the
linear layers by the scan of chunk summaries), the KV rows and the linear layers' states handed to DCP
decode ranks (the attention KV sharded, the states replicated), greedy decode. Prompts of uneven lengths,
one of them a single token (shorter than the PCP size). Checked:

- tokens under PCP 1 / 2, DCP 1 / 2, PCP 2 + DCP 2 and P/D equal HF ``generate`` (and so each other);
- prompt logits close to HF's (HF computes its norms, softmax and delta rule in float32 even for a float64
  model, so that bound is float32's), and PCP's equal to our one device's to float64 rounding (1e-12);
- every DCP rank holds all the states (replicated): the reported bytes are the attention share plus them;
- speculative decoding (n-gram drafts, the MTP module) gives HF's tokens too, P/D included;
- the one-line refusals: the step loop, a cached prefix, a KV pool in the demo;
- the Qwen3.5 families (``qwen3_5``: split projections, dense MLPs; ``qwen3_5_moe``: MoE in every layer), float64
  text models: PCP 2 -> DCP 2 tokens equal HF ``generate``;
- ``cpattn demo --model-type qwen3_next`` refuses a KV pool before any rank starts (exit 2). Its stages run in
  ``tests/test_demo.py::test_demo_runs_every_offered_model_type[qwen3_next]`` (every token equal to one device).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import perturbed  # noqa: E402

from cpattn.engine import driver  # noqa: E402
from cpattn.engine.backends.hybrid import HybridCache  # noqa: E402
from cpattn.models import qwen3_next as qn  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, NEW, PROMPT_LENS = 80, 6, (13, 1, 6)
PATTERN = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
_REF: dict = {}


def reference():
    """(cfg, params, prompts, HF prompt logits per request, HF greedy tokens per request), float64."""
    if not _REF:
        hf_cfg = transformers.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=5, num_attention_heads=6,
            num_key_value_heads=1, head_dim=8, layer_types=PATTERN, linear_conv_kernel_dim=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            mlp_only_layers=[2], initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None,
            rms_norm_eps=1e-5)
        hf = perturbed(transformers.Qwen3NextForCausalLM, hf_cfg, seed=3).double()
        cfg = qn.Qwen3NextConfig.from_hf(hf.config)
        params = qn.load_params(hf.state_dict())
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPT_LENS]
        logits, tokens = [], []
        with torch.no_grad():
            for p in prompts:
                logits.append(hf(p[None]).logits[0])
                out = hf.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=NEW,
                                  do_sample=False, pad_token_id=0)
                tokens.append(out[0, p.numel():])
        _REF.update(cfg=cfg, params=params, prompts=[p.tolist() for p in prompts], logits=logits,
                    tokens=torch.stack(tokens))
    return _REF["cfg"], _REF["params"], _REF["prompts"], _REF["logits"], _REF["tokens"]


def run(pcp: int, dcp: int, pd: bool = False, **kw):
    cfg, params, prompts, _, _ = reference()
    pre, dec = driver.engine_configs("qwen3_next", cfg, pcp_size=pcp, dcp_size=dcp, block_size=4,
                                     interleave_size=4 if pd else 1, pd=pd, **kw)
    return driver.generate("qwen3_next", params, cfg, prompts, NEW, prefill=pre, decode=dec)


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("pcp,dcp,pd", [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False),
                                        (2, 2, True)], ids=["one", "pcp2", "dcp2", "pcp2-dcp2", "pd-2-2"])
def test_greedy_tokens_equal_hf_generate(pcp, dcp, pd):
    _, _, _, hf_logits, hf_tokens = reference()
    gen = run(pcp, dcp, pd)
    assert torch.equal(gen.tokens, hf_tokens), f"PCP {pcp} DCP {dcp} P/D {pd}: {gen.tokens} vs HF {hf_tokens}"
    if gen.prompt_logits is not None:
        for b, got in enumerate(gen.prompt_logits.split(list(PROMPT_LENS))):
            assert got.dtype == torch.float64
            assert rel(got, hf_logits[b]) <= 1e-5, f"request {b}"


def test_pcp_prompt_logits_equal_one_device_to_float64_rounding():
    one, two = run(1, 1), run(2, 2)
    assert rel(two.prompt_logits, one.prompt_logits) <= 1e-12
    assert rel(two.logits, one.logits) <= 1e-12


def test_dcp_ranks_hold_every_state_and_their_share_of_the_kv():
    cfg, params, prompts, _, _ = reference()
    states = qn.recurrent_cache(cfg, batch=len(prompts), dtype=torch.float64)
    one, two = run(1, 1).facts.kv_bytes, run(1, 2).facts.kv_bytes
    attn_one, attn_two = one - states.state_bytes(), two - states.state_bytes()
    assert states.state_bytes() > 0 and 0 < attn_two < attn_one  # the attention KV is sharded, the states not
    from cpattn.comm.sim import SimMesh
    from cpattn.engine.batch import Prompts

    pre, dec = driver.engine_configs("qwen3_next", cfg, dcp_size=2)
    cache = qn.FAMILY.backend.new_cache(qn.FAMILY, cfg, params, Prompts.of(prompts), NEW, dec, 0,
                                        SimMesh(1).groups()[0])
    assert isinstance(cache, HybridCache) and cache.state_bytes() == states.state_bytes()
    assert cache.kv_bytes() == cache.attention_kv_bytes() + cache.state_bytes()


def test_step_loop_refuses_hybrid_in_one_line():
    from cpattn.comm.sim import SimMesh
    from cpattn.engine.runner import StepRunner

    cfg, params, _, _, _ = reference()
    with pytest.raises(ValueError, match=r"qwen3_next keeps its own cache \(ModelFamily.cache='hybrid': .*\): build "
                                         r"LLMEngine \(it picks cpattn.engine.runner_hybrid.HybridStepRunner\)"):
        StepRunner(SimMesh(1).groups()[0], "qwen3_next", params, cfg, num_blocks=8, block_size=4, max_model_len=32)


def test_a_cached_prefix_is_refused_in_one_line():
    from cpattn.comm.sim import SimMesh
    from cpattn.engine.kv_rows import row_width
    from cpattn.engine.prefill_steps import Prefix

    cfg, params, prompts, _, _ = reference()
    pre, dec = driver.engine_configs("qwen3_next", cfg)
    prefix = Prefix(torch.zeros(4, row_width(qn.kv_layouts(cfg)), dtype=torch.float64), (4, 0, 0))
    with pytest.raises(ValueError, match=r"^a cached prefix \(prefix caching\) for qwen3_next: .* no snapshot of "
                                         r"the linear layers' states .*; run without a prefix$"):
        driver.generate_on_rank(SimMesh(1).groups()[0], "qwen3_next", params, cfg, prompts, 2, prefill=pre,
                                decode=dec, prefix=prefix)


@pytest.mark.parametrize("pcp,dcp,pd,method", [(1, 2, False, "ngram"), (2, 2, False, "mtp"), (2, 2, True, "mtp")],
                         ids=["dcp2-ngram", "pcp2-dcp2-mtp", "pd-2-2-mtp"])
@pytest.mark.filterwarnings("ignore::cpattn.config.GuideCompatWarning")  # MTP with PCP on a GQA model: a note
def test_speculative_decoding_gives_hf_generate_tokens(pcp, dcp, pd, method):
    """Drafts in the fixed-batch path (n-gram; Qwen3-Next's MTP module, random weights: it reads the prompt's
    hidden states from the prefill, across P/D too, and each step's verified rows): HF's greedy tokens."""
    from cpattn.drafters.qwen3_next_mtp import Qwen3NextMTPDrafter
    from cpattn.drafters.ngram import NgramDrafter

    cfg, params, prompts, _, hf_tokens = reference()
    drafter = NgramDrafter(max_ngram=2) if method == "ngram" else Qwen3NextMTPDrafter.random(cfg, params, std=0.2)
    pre, dec = driver.engine_configs("qwen3_next", cfg, pcp_size=pcp, dcp_size=dcp, block_size=4,
                                     interleave_size=4 if pd else 1, pd=pd, num_speculative_tokens=2,
                                     speculative_method=method)
    gen = driver.generate("qwen3_next", params, cfg, prompts, NEW, prefill=pre, decode=dec, drafter=drafter)
    assert torch.equal(gen.tokens, hf_tokens), f"{method} PCP {pcp} DCP {dcp} P/D {pd}: {gen.tokens} vs {hf_tokens}"
    assert gen.stats.drafted > 0


QWEN35 = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
              head_dim=8, layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3,
              initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None, rms_norm_eps=1e-5)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_qwen35_families_under_pcp2_dcp2_equal_hf_generate(name):
    """Qwen3.5 (split projections, dense MLPs) and Qwen3.5-MoE (MoE in every layer) text models, float64:
    PCP 2 -> DCP 2 through the engine gives HF ``generate``'s greedy tokens."""
    if name == "qwen3_5":
        hf_cfg = transformers.Qwen3_5TextConfig(**QWEN35, intermediate_size=64)
        cls = transformers.Qwen3_5ForCausalLM
    else:
        hf_cfg = transformers.Qwen3_5MoeTextConfig(**QWEN35, moe_intermediate_size=16,
                                                   shared_expert_intermediate_size=24, num_experts=4,
                                                   num_experts_per_tok=2)
        cls = transformers.Qwen3_5MoeForCausalLM
    hf = perturbed(cls, hf_cfg, seed=5).double()
    from cpattn.models.family import get_family

    fam = get_family(name)
    cfg, params = fam.config_class.from_hf(hf.config), qn.load_params(hf.state_dict())
    assert cfg.split_projections and set(cfg.mlp_layer_types) == {"dense" if name == "qwen3_5" else "sparse"}
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 1, 5)]
    with torch.no_grad():
        want = torch.stack([hf.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=NEW,
                                        do_sample=False, pad_token_id=0)[0, p.numel():] for p in prompts])
    pre, dec = driver.engine_configs(name, cfg, pcp_size=2, dcp_size=2, block_size=4)
    gen = driver.generate(name, params, cfg, [p.tolist() for p in prompts], NEW, prefill=pre, decode=dec)
    assert torch.equal(gen.tokens, want), f"{name}: {gen.tokens} vs HF {want}"


def test_demo_refuses_a_kv_pool_for_qwen3_next_before_any_rank_starts(capsys, tmp_path):
    from cpattn.bench import demo

    with pytest.raises(SystemExit) as e:
        demo.main(["--model-type", "qwen3_next", "--prompt-len", "24", "--kv-pool", f"lmdb:{tmp_path / 'pool'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "qwen3_next keeps its own cache (ModelFamily.cache='hybrid')" \
        in err[0], err
