"""The whole-model part of ``cpattn bench pcp``: the demo's tiny Qwen3 prefilling one prompt, one rank vs PCP."""

from __future__ import annotations

from cpattn.bench import harness
from cpattn.bench.harness import Comparison, Samples


def model_rank(group, prompt_len: int, reps: int, method: str):
    """The demo's embedded tiny Qwen3: one prompt's whole prefill (TTFT: every layer, the first token's logits)
    on one rank vs PCP over the group, interleaved; the non-attention work is split with the tokens."""
    import torch
    from cpattn.bench.demo_setup import EMBEDDED_STD
    from cpattn.comm.sim import SimMesh
    from cpattn.engine.batch import Prompts
    from cpattn.models.family import get_family
    from cpattn.engine.options import Algorithms
    from cpattn.engine.prefill import prefill

    fam = get_family("qwen3")
    cfg = fam.config_class.tiny()  # the demo's embedded model
    params = fam.init_params(cfg, seed=0, std=EMBEDDED_STD)
    tokens = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1))
    batch = Prompts(tokens, (prompt_len,))
    algo = Algorithms(pcp_method=method)
    solo = SimMesh(1).groups()[0]
    runs = {"one": (lambda: prefill(solo, fam, params, cfg, batch, algorithms=algo).first_logits)
            if group.rank == 0 else (lambda: None),
            "pcp": lambda: prefill(group, fam, params, cfg, batch, algorithms=algo).first_logits}
    s = harness.compare(runs, reps, group=group, warmup=1).samples  # interleaved rounds
    diff = None
    if group.rank == 0:
        diff = (s["one"].result - s["pcp"].result).abs().max().item()
    return {"samples": {k: Samples(v.wall, v.cpu) for k, v in s.items()}, "max_diff": diff,
            "layers": cfg.num_hidden_layers}


def model_report(res: dict, prompt_len: int, world: int, method: str) -> dict:
    s = res["samples"]
    c = Comparison(s)
    r, rc = c.ratio("pcp", "one"), c.ratio("pcp", "one", clock="cpu")
    print(f"\nWhole-model PCP prefill (the demo's tiny Qwen3, {res['layers']} layers, one {prompt_len}-token prompt, "
          f"{method}): TTFT on {world} gloo ranks / one rank = {r} (median [low-high] of per-round wall ratios, "
          f"best {r.best:.3f}); CPU time {rc}; one rank {1e3 * s['one'].median:.0f} ms, PCP "
          f"{1e3 * s['pcp'].median:.0f} ms; first-token logits max |diff| {res['max_diff']:.2e}")
    return {"prompt_len": prompt_len, "method": method, "ttft_ratio": r.as_dict(), "cpu_ratio": rc.as_dict(),
            "one_ms": 1e3 * s["one"].median, "pcp_ms": 1e3 * s["pcp"].median, "max_diff": res["max_diff"]}
