"""DeepSeek-V4 in bfloat16 through the engine, against Hugging Face in float64 (DESIGN.md §5's bf16 rule).

The reference is transformers' model in float64 (its norms, hyper-connections,
RoPE and indexer scoring stay float32 inside: ~1e-7, far below bf16's
error). The baseline is the same Hugging Face model run in bfloat16 -- a
plain torch bf16 implementation. Ours runs the engine's stages with bf16
parameters (the reference's float32 tensors kept float32, as it does):
the prefill (one rank, and PCP 2) gives the prompt logits; the decode
program (one rank, and DCP 2) then decodes 12 given tokens one step at a
time (teacher-forced, so every run sees the same sequence), each step's
logits compared at its position. Per position the error is max abs over
the vocabulary / max |reference|; ours must be within twice the baseline
in median over the positions (the rounding error) and in max (bf16 flips
a near-tied discrete choice now and then -- an expert of the top-2 router,
an entry of the CSA top-k -- here and in the baseline alike, at different
positions, and one flip moves a position's logits by ~10%).
"""

from __future__ import annotations

import copy

import pytest
import torch

import cpattn
from cpattn.comm.sim import SimMesh
from cpattn.config import EngineConfig
from cpattn.engine import Prompts
from cpattn.models import deepseek_v4 as v4
from test_v4_model_hf import ref

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
FORCED = 12
STAGES = v4.FAMILY.stages


def row_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position: max abs error over the vocabulary / max |reference| (the whole reference): [n]."""
    return (a.double() - b.double()).abs().amax(-1) / b.double().abs().max()


def engine_logits(group, params, cfg, prompts: list[torch.Tensor], forced: list[torch.Tensor], pcp: bool):
    """Prompt logits [sum L, V] from the prefill (over ``group`` when pcp, else this rank alone) and the
    decode logits [B, FORCED, V] of the forced tokens, decoded over ``group`` (DCP)."""
    p = Prompts.of([x.tolist() for x in prompts])
    pg = group if pcp else SimMesh(1).groups()[0]
    out = STAGES.prefill(pg, params, cfg, p, prompt_logits=True)
    dec = EngineConfig.create(tp_size=group.size, dcp_size=group.size, attention="v4", block_size=4)
    cache = STAGES.new_cache(cfg, params, p, FORCED, dec, 0, group)
    STAGES.place(cache, STAGES.collect(pg, out))
    prog = STAGES.decode_program(group, params, cfg, cache)
    lens, steps = list(p.prompt_lens), []
    for j in range(FORCED):
        tokens = torch.stack([f[j] for f in forced])  # [B]: each request's token at position lens[b]
        steps.append(prog.step(prog.state, prog.batch([0, 1], lens, tokens))[0])
        lens = [n + 1 for n in lens]
        prog.commit([0, 1], lens)
    return out.prompt_logits, torch.stack(steps, 1)


def test_bf16_logits_within_twice_plain_bf16_error():
    r = ref()
    cfg = v4.DeepseekV4Config.from_hf(r.hf.config)
    params = v4.params_from_state(r.hf.state_dict(), dtype=torch.bfloat16)
    forced = [t[:FORCED] for t in r.tokens]  # the float32 run's greedy tokens: any fixed sequence will do
    hf64, hf16 = copy.deepcopy(r.hf).double(), copy.deepcopy(r.hf).to(torch.bfloat16)
    keep = type(r.hf)._keep_in_fp32_modules_strict  # what from_pretrained(dtype=bfloat16) keeps float32
    with torch.no_grad():
        for (name, t), (_, t32) in zip([*hf16.named_parameters(), *hf16.named_buffers()],
                                       [*r.hf.named_parameters(), *r.hf.named_buffers()]):
            if t.is_floating_point() and any(k in name.split(".") for k in keep):
                t.data = t32.detach().clone()
    for m in (hf64, hf16):
        m.config._experts_implementation = "eager"  # plain torch experts (grouped_mm has no float64)
    want, base = [], {"prompt": [], "decode": []}
    with torch.no_grad():
        for p, f in zip(r.prompts, forced):
            seq = torch.cat([p, f])[None]
            exact, plain = hf64(seq).logits[0], hf16(seq).logits[0]  # [L + FORCED, V]
            n = p.numel()
            want.append((exact[:n], exact[n : n + FORCED]))  # prompt rows; the forced tokens' rows
            base["prompt"].append(row_err(plain[:n], exact[:n]))
            base["decode"].append(row_err(plain[n : n + FORCED], exact[n : n + FORCED]))
    base = {k: torch.cat(v) for k, v in base.items()}

    def rank(group, pcp):
        return engine_logits(group, params, cfg, r.prompts, forced, pcp)

    for size, pcp in ((1, False), (2, True), (2, False)):
        prompt_logits, decode_logits = cpattn.simulate(size, rank, pcp)[0]
        lens = [p.numel() for p in r.prompts]
        got = {"prompt": torch.cat([row_err(x, w) for x, (w, _) in zip(prompt_logits.split(lens), want)]),
               "decode": torch.cat([row_err(decode_logits[b], w) for b, (_, w) in enumerate(want)])}
        for part in ("prompt", "decode"):
            ours, plain = got[part], base[part]
            where = f"size {size}, pcp {pcp}, {part}"
            assert ours.median() <= 2 * plain.median(), f"{where}: median {ours.median():.2e} vs {plain.median():.2e}"
            assert ours.max() <= 2 * plain.max(), f"{where}: max {ours.max():.2e} vs {plain.max():.2e}"
