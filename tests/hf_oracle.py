"""Hugging Face ``transformers`` as the whole-model oracle: tiny seeded models, their outputs, the comparisons.

Shared by the per-family exactness tests (test_models_hf.py, test_models_moe_hf.py):

- :func:`perturbed`: a seeded random-init HF model (eager attention and
  experts, eval) with norm weights and router biases perturbed, so every
  parameter matters;
- :class:`Reference`: one HF model, our params/config, and the HF outputs
  (prompt logits, ``generate(do_sample=False)`` tokens and logits) for the
  prompts, computed once;
- :meth:`Reference.check`: prompt logits within 1e-4 relative; tokens equal
  up to a near-tie flip (DESIGN.md §5, :func:`near_tie.check_tokens`): if a
  token differs, the reference's top-2 margin at the first differing step
  must be below twice the measured logit error there, the flip is recorded,
  and the steps after it are not compared;
- :func:`forward_logits`: one prefill forward of a family on one device.
"""

from __future__ import annotations

import torch
from near_tie import check_tokens, rel_err  # noqa: F401 (the oracle's comparisons; also imported from here)

from cpattn.engine.dense_cache import DenseKVCache
from cpattn.models import normalize_params

NEW_TOKENS = 32
PROMPT_LENS = (21, 13)  # odd, uneven over 2P chunks; packed together in one batch
VOCAB = 128


def perturbed(model_class, config, seed: int = 0):
    """``model_class(config)`` seeded, eager, eval, with norms and router biases moved off their init values."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = model_class(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "e_score_correction_bias" in name:
                t.add_(0.1 * torch.randn(t.shape, generator=g))
    return model


def perturbed_v4(config, seed: int = 0):
    """A seeded, eager ``DeepseekV4ForCausalLM(config)`` with hash-routing tables drawn and norms / biases /
    sinks / scales moved off their init values (so every parameter kind matters to the logits)."""
    import transformers

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                t.copy_(torch.randint(0, 4, t.shape, generator=g))
            elif any(s in name for s in ("norm", "bias", "sinks", "base", "scale")):
                t.add_(0.3 * torch.randn(t.shape, generator=g))
    return model


def forward_logits(module, params: dict, cfg, tokens: torch.Tensor, cu_seqlens: list[int], **kw):
    """``module.forward`` of packed prompts (requests by ``cu_seqlens``) on a fresh dense cache."""
    lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    dtype = params["model.embed_tokens.weight"].dtype
    cache = DenseKVCache.empty(module.FAMILY.kv_layouts(cfg), batch=len(lens), max_len=max(lens), dtype=dtype)
    return module.forward(params, cfg, tokens, cache.step(lens), **kw)


class Reference:
    """A family's HF model, our params/config, and the HF outputs for the prompts."""

    def __init__(self, name: str, module, hf, flips: list):
        self.name, self.module, self.hf, self.flips = name, module, hf, flips
        self.cfg = module.FAMILY.config_class.from_hf(hf.config)
        self.params = normalize_params(hf.state_dict())
        g = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPT_LENS]
        self.tokens, self.logits, self.prompt_logits = [], [], []
        with torch.no_grad():
            for p in self.prompts:
                self.prompt_logits.append(hf(p[None]).logits[0])  # [L, V]
                # explicit mask: HF would otherwise mask prompt tokens equal to pad_token_id
                out = hf.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
                self.tokens.append(out.sequences[0, p.numel():])  # [N]
                self.logits.append(torch.stack(out.logits, 1)[0].float())  # [N, V]

    def check(self, gen) -> None:
        """Prompt logits within 1e-4 relative; tokens equal up to a near-tie flip.

        A generation of n <= NEW_TOKENS tokens is compared with the first n reference tokens.
        """
        n = gen.tokens.shape[1]
        assert gen.prompt_logits is not None, f"{self.name}: the run returned no prompt logits to compare"
        at = 0
        for b, p in enumerate(self.prompts):
            what = f"{self.name} request {b}"
            ref, got = self.prompt_logits[b], gen.prompt_logits[at : at + p.numel()]
            assert rel_err(got, ref) <= 1e-4, f"{what}: prompt logits off by {rel_err(got, ref):.2e}"
            at += p.numel()
            check_tokens(gen.tokens[b], gen.logits[b], self.tokens[b][:n], self.logits[b][:n], what, self.flips)


def check_hidden(ref: Reference) -> None:
    """The forward's ``hidden_layers`` contract against HF's ``output_hidden_states`` on the first prompt.

    HF's entry i + 1 is the residual stream after layer i, except the last,
    which HF ties to the final-normed state; ``hidden["norm"]`` covers every
    row even when ``logits_index`` selects some.
    """
    from cpattn.models.common import lm_head, rms_norm

    module, params, cfg, tokens = ref.module, ref.params, ref.cfg, ref.prompts[0]
    t, n = tokens.numel(), cfg.num_hidden_layers
    with torch.no_grad():
        hf_states = [h[0] for h in ref.hf(tokens[None], output_hidden_states=True).hidden_states]  # n + 1 x [T, H]
    assert len(hf_states) == n + 1
    rows = torch.tensor([t - 1, 2, 5])
    logits, hidden = forward_logits(module, params, cfg, tokens, [0, t], logits_index=rows,
                                    hidden_layers=tuple(range(n)))
    assert sorted(hidden, key=str) == [*range(n), "norm"]
    assert hidden["norm"].shape == (t, cfg.hidden_size) and logits.shape == (3, cfg.vocab_size)
    assert torch.equal(torch.nn.functional.linear(hidden["norm"][rows], lm_head(params, cfg)), logits)
    assert rel_err(logits, ref.prompt_logits[0][rows]) <= 1e-4
    for i in range(n - 1):
        assert rel_err(hidden[i], hf_states[i + 1]) <= 1e-5, f"{ref.name}: layer {i} residual stream"
    assert rel_err(hidden["norm"], hf_states[n]) <= 1e-5
    assert torch.equal(rms_norm(hidden[n - 1], params["model.norm.weight"], cfg.rms_norm_eps), hidden["norm"])
    only, norm_only = forward_logits(module, params, cfg, tokens, [0, t], hidden_layers=())
    assert list(norm_only) == ["norm"] and torch.equal(norm_only["norm"], hidden["norm"])
    assert torch.equal(only, forward_logits(module, params, cfg, tokens, [0, t]))
