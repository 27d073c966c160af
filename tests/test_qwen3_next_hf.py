"""Qwen3-Next (cpattn.models.qwen3_next) on one device against a tiny seeded transformers 5.24 Qwen3NextForCausalLM.

Odd sizes on purpose: 3 query heads / 1 KV head (head_dim 16, partial RoPE 0.25), linear heads 1 key / 3 value
(Dk 8, Dv 12), 5 layers with the pattern linear, full, linear, linear, full (not every 4th), MoE (6 experts,
top-2, shared expert) except ``mlp_only_layers``, and a dense variant (no experts). fp32:

- prompt logits within 1e-4 relative of HF (two prompts packed in one step, 21 and 13 tokens);
- the same after a chunked prefill (odd chunk sizes 5, 3, ..., the states carried between chunks);
- 16 greedy tokens equal to HF ``generate`` (up to counted near-tie flips, DESIGN.md §5), decode through the
  recurrent op;
- ``from_hf`` on HF's config, and the one-line refusals.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import perturbed  # noqa: E402
from near_tie import check_tokens, rel_err  # noqa: E402

from cpattn.engine.dense_cache import DenseKVCache  # noqa: E402
from cpattn.models import qwen3_next as qn  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, NEW, PROMPT_LENS = 96, 16, (21, 13)
PATTERN = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
FLIPS: list = []


def hf_config(**over):
    base = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=5, num_attention_heads=3,
                num_key_value_heads=1, head_dim=16, layer_types=PATTERN, linear_conv_kernel_dim=4,
                linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=1, linear_num_value_heads=3,
                num_experts=6, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=28,
                mlp_only_layers=[2], initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                rms_norm_eps=1e-5)
    return transformers.Qwen3NextConfig(**{**base, **over})


_REFS: dict = {}


def reference(name):
    if name not in _REFS:
        over = {} if name == "moe" else {"num_experts": 0}
        hf = perturbed(transformers.Qwen3NextForCausalLM, hf_config(**over), seed=0)
        cfg = qn.Qwen3NextConfig.from_hf(hf.config)
        params = qn.load_params(hf.state_dict())
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPT_LENS]
        logits, tokens, gen_logits = [], [], []
        with torch.no_grad():
            for p in prompts:
                logits.append(hf(p[None]).logits[0])
                out = hf.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=NEW,
                                  do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
                tokens.append(out.sequences[0, p.numel():])
                gen_logits.append(torch.stack(out.logits, 1)[0].float())
        _REFS[name] = (hf, cfg, params, prompts, logits, tokens, gen_logits)
    return _REFS[name]


def caches(cfg, batch, max_len):
    return DenseKVCache.empty(qn.kv_layouts(cfg), batch=batch, max_len=max_len), qn.recurrent_cache(cfg, batch=batch)


def step(params, cfg, kv, rec, pieces):
    """One forward of ``pieces[b]`` (a token tensor per request, maybe empty); returns (logits, kv, rec)."""
    lens = [p.numel() for p in pieces]
    a, lin = kv.step(lens), rec.step(lens)
    logits = qn.forward(params, cfg, torch.cat(pieces), a, lin)
    return logits, a.finish(), lin.finish()


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_prompt_logits_match_hf(name):
    hf, cfg, params, prompts, ref_logits, _, _ = reference(name)
    assert cfg.layer_types == tuple(PATTERN)
    assert cfg.mlp_layer_types == (("sparse", "sparse", "dense", "sparse", "sparse") if name == "moe" else
                                   ("dense",) * 5)
    kv, rec = caches(cfg, 2, 40)
    with torch.no_grad():
        logits, _, _ = step(params, cfg, kv, rec, prompts)
    got = logits.split(list(PROMPT_LENS))
    for b in range(2):
        assert rel_err(got[b], ref_logits[b]) <= 1e-4, f"{name} request {b}: {rel_err(got[b], ref_logits[b]):.2e}"


def test_chunked_prefill_carries_the_states():
    hf, cfg, params, prompts, ref_logits, _, _ = reference("moe")
    kv, rec = caches(cfg, 2, 40)
    got = [[], []]
    at = [0, 0]
    with torch.no_grad():
        for size in (5, 3, 1, 7, 2, 6):  # odd chunk sizes; request 1 runs out (empty pieces) before request 0
            pieces = [p[at[b]:at[b] + size] for b, p in enumerate(prompts)]
            logits, kv, rec = step(params, cfg, kv, rec, pieces)
            for b, part in enumerate(logits.split([x.numel() for x in pieces])):
                got[b].append(part)
                at[b] += pieces[b].numel()
    assert at == list(PROMPT_LENS)
    for b in range(2):
        assert rel_err(torch.cat(got[b]), ref_logits[b]) <= 1e-4


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_greedy_tokens_match_hf_generate(name):
    hf, cfg, params, prompts, _, ref_tokens, ref_gen_logits = reference(name)
    kv, rec = caches(cfg, 2, 21 + NEW)
    toks, logs = [[], []], [[], []]
    with torch.no_grad():
        logits, kv, rec = step(params, cfg, kv, rec, prompts)
        last = logits[torch.tensor([PROMPT_LENS[0] - 1, sum(PROMPT_LENS) - 1])]
        for _ in range(NEW):
            nxt = last.argmax(-1)
            for b in range(2):
                toks[b].append(int(nxt[b]))
                logs[b].append(last[b])
            last, kv, rec = step(params, cfg, kv, rec, [nxt[:1], nxt[1:]])  # one token each: the decode op
    for b in range(2):
        check_tokens(torch.tensor(toks[b]), torch.stack(logs[b]), ref_tokens[b], ref_gen_logits[b],
                     f"{name} request {b}", FLIPS)
    assert len(FLIPS) <= 1, FLIPS


def test_from_hf_reads_the_interval_and_refuses_bad_fields():
    cfg = qn.Qwen3NextConfig.from_hf(hf_config(layer_types=None, full_attention_interval=3, num_hidden_layers=6))
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    assert cfg.rotary_dim == 4 and cfg.conv_channels == 2 * 8 + 36
    d = hf_config().to_dict()
    with pytest.raises(ValueError, match=r"'linear_num_key_heads' is 2; expected a divisor of linear_num_value_heads"):
        qn.Qwen3NextConfig.from_hf({**d, "linear_num_key_heads": 2})
    with pytest.raises(ValueError, match=r"'layer_types' is .*; expected a list of 'linear_attention', 'full_att"):
        qn.Qwen3NextConfig.from_hf({**d, "layer_types": ["sliding_attention"] * 5})
    with pytest.raises(ValueError, match=r"model_type is 'qwen3'; this family expects one of \('qwen3_next'"):
        qn.Qwen3NextConfig.from_hf({**d, "model_type": "qwen3"})
