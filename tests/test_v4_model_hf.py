"""cpattn.models.deepseek_v4 against Hugging Face transformers' DeepSeek-V4 (the oracle).

A tiny seeded model mixing all three layer types (sliding window 8, CSA
every 4 tokens with top-3 of the entries, HCA every 16 tokens), YaRN on the
compressed layers, a hash-routed MoE layer, every bias / norm / sink /
position bias perturbed so each matters. Prompts of 5 tokens (shorter than
the window and the HCA ratio) and 37 (longer than both), packed in one batch:

- prompt logits within 1e-4 (relative) of the Hugging Face forward;
- 32 greedy tokens equal to ``generate(do_sample=False)``, decode logits
  within 1e-4; a differing token is allowed only at a near tie (the
  reference's top-2 margin at most twice the measured logit error there,
  DESIGN.md §5), and counted;
- the same from a checkpoint directory (config.json + safetensors);
- a step of k speculative tokens then a rewind of k leaves the cache's
  live state bit-identical and the following tokens unchanged;
- speculative greedy decoding (draft k, verify 1 + k rows, rewind the
  rejected) emits exactly the reference's greedy tokens, which the
  reference itself cannot do (its compressor state cannot be rewound);
- the whole model with DCP steps (N = 2) decodes like one device.

16 indexer heads: with ReLU scores, few heads give exact score ties (all
heads negative -> 0), where the reference's ``torch.topk`` picks an
unspecified one of the tied entries; ours picks the earliest.
"""

from __future__ import annotations

import pytest
import torch
from hf_oracle import perturbed_v4
from near_tie import check_tokens

transformers = pytest.importorskip("transformers")

from cpattn.models import deepseek_v4 as v4  # noqa: E402
from cpattn.v4.step import V4Step  # noqa: E402

VOCAB, NEW = 64, 32
PROMPTS = (5, 37)
FLIPS: list[tuple[str, int]] = []  # near-tie flips seen (counted, DESIGN.md §5)

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_model(seed: int = 0):
    cfg = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        head_dim=16, q_lora_rank=24, partial_rotary_factor=0.5, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}, sliding_window=8,
        o_groups=2, o_lora_rank=8, index_n_heads=16, index_head_dim=12, index_topk=3, hc_mult=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=128, initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return perturbed_v4(cfg, seed)


def greedy(params, cfg, prompts, n_new, cache, group=None):
    """Prefill every prompt in one packed step, then n_new one-token steps: (prompt logits, tokens, logits).

    With a DCP ``group`` every rank runs the same loop over its shard of the cache."""
    step = V4Step(cache, [p.numel() for p in prompts], group)
    logits = v4.forward(params, cfg, torch.cat(prompts), step)  # [sum L, V]
    cache = step.finish()
    ends = torch.tensor([p.numel() for p in prompts]).cumsum(0) - 1
    tok, toks, steps = logits[ends].argmax(-1), [], [logits[ends]]
    for _ in range(n_new - 1):
        toks.append(tok)
        step = V4Step(cache, [1] * len(prompts), group)
        out = v4.forward(params, cfg, tok, step)
        cache = step.finish()
        steps.append(out)
        tok = out.argmax(-1)
    toks.append(tok)
    return logits, torch.stack(toks, 1), torch.stack(steps, 1), cache


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


class Ref:
    def __init__(self):
        self.hf = hf_model()
        g = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPTS]
        self.prompt_logits, self.tokens, self.logits = [], [], []
        with torch.no_grad():
            for p in self.prompts:
                self.prompt_logits.append(self.hf(p[None]).logits[0])
                out = self.hf.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=NEW,
                                       do_sample=False, pad_token_id=0, output_logits=True,
                                       return_dict_in_generate=True)
                self.tokens.append(out.sequences[0, p.numel():])
                self.logits.append(torch.stack(out.logits, 1)[0])

    def check(self, prompt_logits, tokens, logits):
        at = 0
        for b, p in enumerate(self.prompts):
            got = prompt_logits[at : at + p.numel()]
            at += p.numel()
            err = rel(got, self.prompt_logits[b])
            assert err <= 1e-4, f"request {b}: prompt logits off by {err:.2e}"
            check_tokens(tokens[b], logits[b], self.tokens[b], self.logits[b], f"request {b}", FLIPS)


_REF: list[Ref] = []


def ref() -> Ref:
    if not _REF:
        _REF.append(Ref())
    return _REF[0]


def test_config_and_rope_tables_match_hf():
    r = ref()
    cfg = v4.DeepseekV4Config.from_hf(r.hf.config)
    assert cfg.layer_types == ("sliding", "csa", "hca") and (cfg.csa_ratio, cfg.hca_ratio) == (4, 16)
    rot = r.hf.model.rotary_emb
    for name, table in (("main", cfg.rope_main), ("compress", cfg.rope_compress)):
        inv, factor = v4.rope_inv_freq(cfg.qk_rope_head_dim, table, cfg.max_position_embeddings)
        assert torch.equal(inv, getattr(rot, f"{name}_inv_freq"))
        assert factor == getattr(rot, f"{name}_attention_scaling")


@pytest.mark.slow  # a Hugging Face round trip: the full suite runs it, the fast lane does not
def test_prompt_logits_and_greedy_tokens_match_hf():
    r = ref()
    cfg = v4.DeepseekV4Config.from_hf(r.hf.config)
    params = v4.params_from_state(r.hf.state_dict())
    cache = v4.empty_cache(cfg, batch=2, max_len=96, block_size=4, seed=3)  # shuffled blocks
    prompt_logits, tokens, logits, _ = greedy(params, cfg, r.prompts, NEW, cache)
    r.check(prompt_logits, tokens, logits)


def test_checkpoint_directory(tmp_path):
    r = ref()
    r.hf.save_pretrained(tmp_path)
    cfg, params = v4.load(str(tmp_path))
    assert cfg == v4.DeepseekV4Config.from_hf(r.hf.config)
    p = r.prompts[1]
    step = V4Step(v4.empty_cache(cfg, batch=1, max_len=64), [p.numel()])
    assert rel(v4.forward(params, cfg, p, step), r.prompt_logits[1]) <= 1e-4


@pytest.mark.slow  # a Hugging Face round trip: the full suite runs it, the fast lane does not
def test_rewind_restores_the_cache_bit_for_bit():
    """Append k draft tokens, rewind k: the live state is the one before, bit for bit, and the next
    32 greedy tokens (and logits) equal a run that never drafted."""
    r = ref()
    cfg = v4.DeepseekV4Config.from_hf(r.hf.config)
    params = v4.params_from_state(r.hf.state_dict())
    k = 3

    def state_bits(cache):
        return {n: t.view(torch.int32) if t.is_floating_point() else t for n, t in cache.live_state().items()}

    base = v4.empty_cache(cfg, batch=2, max_len=96, max_rewind=k, block_size=4, seed=5)
    _, _, _, plain = greedy(params, cfg, r.prompts, 1, base)  # prefill + first token
    before = state_bits(plain)
    draft = torch.randint(0, VOCAB, (2 * k,), generator=torch.Generator().manual_seed(9))
    step = V4Step(plain, [k, k])
    v4.forward(params, cfg, draft, step)
    rewound = step.finish().rewind([k, k])
    after = state_bits(rewound)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} differs after append + rewind"
    ctrl = v4.empty_cache(cfg, batch=2, max_len=96, max_rewind=k, block_size=4, seed=5)
    _, _, _, ctrl = greedy(params, cfg, r.prompts, 1, ctrl)
    tok = torch.stack([r.tokens[b][0] for b in range(2)])
    for _ in range(8):  # the drafted run and a clean run decode identically
        s1, s2 = V4Step(rewound, [1, 1]), V4Step(ctrl, [1, 1])
        a, b = v4.forward(params, cfg, tok, s1), v4.forward(params, cfg, tok, s2)
        assert torch.equal(a, b)
        rewound, ctrl, tok = s1.finish(), s2.finish(), a.argmax(-1)


def test_rewind_past_max_rewind_is_refused():
    cfg = v4.DeepseekV4Config.from_hf(ref().hf.config)
    cache = v4.empty_cache(cfg, batch=1, max_len=32, max_rewind=2)
    step = V4Step(cache, [6])
    v4.forward(v4.params_from_state(ref().hf.state_dict()), cfg, torch.arange(6), step)
    with pytest.raises(ValueError, match="max_rewind=2"):
        step.finish().rewind([3])


@pytest.mark.slow  # a Hugging Face round trip: the full suite runs it, the fast lane does not
def test_speculative_greedy_equals_plain_greedy():
    """Draft k = 3 tokens (the reference's own, some replaced), verify 1 + k rows in one step, keep the
    accepted prefix plus the correction, rewind the rest: the tokens are HF's greedy ones."""
    r = ref()
    cfg = v4.DeepseekV4Config.from_hf(r.hf.config)
    params = v4.params_from_state(r.hf.state_dict())
    k, vocab = 3, cfg.vocab_size
    g = torch.Generator().manual_seed(11)
    cache = v4.empty_cache(cfg, batch=2, max_len=96, max_rewind=k, block_size=4, seed=6)
    step = V4Step(cache, [p.numel() for p in r.prompts])
    logits = v4.forward(params, cfg, torch.cat(r.prompts), step)
    cache = step.finish()
    first = logits[torch.tensor([p.numel() for p in r.prompts]).cumsum(0) - 1]  # [2, V]
    last = first.argmax(-1)  # [2]
    out, rejected = [[int(last[b])] for b in range(2)], 0
    chosen_from = [[first[b]] for b in range(2)]  # the logits row of every emitted token
    while min(len(o) for o in out) < NEW:
        drafts = []
        for b in range(2):
            true = r.tokens[b][len(out[b]) : len(out[b]) + k]
            true = torch.cat([true, torch.zeros(k - true.numel(), dtype=torch.long)])
            wrong = torch.rand(k, generator=g) < 0.3
            drafts.append(torch.where(wrong, (true + 1) % vocab, true))
        step = V4Step(cache, [1 + k, 1 + k])
        rows = v4.forward(params, cfg, torch.cat([torch.cat([last[b : b + 1], drafts[b]]) for b in range(2)]),
                          step).view(2, 1 + k, -1)  # [2, 1 + k, V]
        pred = rows.argmax(-1)
        cache, back = step.finish(), []
        for b in range(2):
            a = int((pred[b, :k] == drafts[b]).long().cumprod(0).sum())  # accepted drafts
            out[b] += drafts[b][:a].tolist() + [int(pred[b, a])]
            chosen_from[b] += list(rows[b, : a + 1])
            last[b] = pred[b, a]
            back.append(k - a)
        rejected += sum(back)
        cache = cache.rewind(back)
    assert rejected > 0  # the rewinds were exercised
    for b in range(2):  # float32: HF's tokens up to a counted near tie (DESIGN.md §5)
        check_tokens(out[b][:NEW], torch.stack(chosen_from[b][:NEW]), r.tokens[b], r.logits[b],
                     f"speculative request {b}", FLIPS)


@pytest.mark.slow
def test_dcp_generation_matches_one_device():
    """The whole model with DCP steps (N = 2, entries sharded, window heads split): the same tokens and
    logits as one device."""
    import cpattn

    r = ref()
    cfg = v4.DeepseekV4Config.from_hf(r.hf.config)
    params = v4.params_from_state(r.hf.state_dict())
    one = greedy(params, cfg, r.prompts, 12, v4.empty_cache(cfg, batch=2, max_len=96, block_size=4))

    def rank(group):
        cache = v4.empty_cache(cfg, batch=2, max_len=96, block_size=4, dcp_rank=group.rank, dcp_size=2, seed=group.rank)
        return greedy(params, cfg, r.prompts, 12, cache, group)[:3]

    for rank_no, got in enumerate(cpattn.simulate(2, rank)):
        torch.testing.assert_close(got[0], one[0], rtol=1e-5, atol=1e-5)
        for b in range(2):  # float32: one device's tokens up to a counted near tie (DESIGN.md §5)
            n = check_tokens(got[1][b], got[2][b], one[1][b], one[2][b], f"DCP rank {rank_no} request {b}", FLIPS)
            torch.testing.assert_close(got[2][b, :n], one[2][b, :n], rtol=1e-5, atol=1e-5)


def test_near_tie_flips_stay_rare():
    """Runs last in this file: of every float32 greedy comparison above, at most one may end in a near-tie flip
    (this seed has none here)."""
    assert len(FLIPS) <= 1, FLIPS
