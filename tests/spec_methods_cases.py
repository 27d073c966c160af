"""Shipped tiny trained targets and draft heads, prompts, a draft recorder and the no-cache draft references,
for the MTP / Eagle3 / DSpark tests (module level: spawned ranks import it by name).

tests/data/speculative holds (bfloat16 on disk, loaded in float64 or float32):

- ``qwen3`` / ``deepseek_v3``: tiny targets trained on the synthetic corpus (``cpattn train-target``);
- ``qwen3-eagle3``, ``qwen3-dspark``, ``deepseek_v3-mtp``, ``deepseek_v3-eagle3``, ``deepseek_v3-dspark``:
  heads trained by self-distillation on the target's greedy continuations (``cpattn train-draft``).

DeepSeek-V4 (DSpark's own target) is not shipped: ``v4_target`` is a random-init tiny V4 and ``v4_head`` a
DSpark head self-distilled on its greedy continuations in a few seconds.
"""

from __future__ import annotations

import functools
import pathlib

import torch

from cpattn.drafters import eagle3 as e3
from cpattn.drafters import mtp as mt
from cpattn.lab import sequence as sq
from cpattn.lab import target as tg
from cpattn.lab.corpus import Corpus
from cpattn.engine.dense_cache import DenseKVCache
from cpattn.drafters.registry import DRAFTERS
from cpattn.engine.family import get_family
from cpattn.models import deepseek_v4 as v4

DATA = pathlib.Path(__file__).resolve().parent / "data" / "speculative"
TARGET_OF = {"mtp": "deepseek_v3", "eagle3": "qwen3", "dspark": "qwen3"}  # the guide's pairing


@functools.cache
def target(name: str, dtype: torch.dtype = torch.float64):
    """(family name, config, params) of a shipped target."""
    return tg.load(DATA / name, dtype=dtype)


@functools.cache
def head(method: str, target_name: str | None = None, dtype: torch.dtype = torch.float64):
    """A shipped draft head for ``target_name`` (default: the guide's target of the method)."""
    return DRAFTERS[method].from_checkpoint(DATA / f"{target_name or TARGET_OF[method]}-{method}", dtype=dtype)


def prompts(name: str = "qwen3") -> list[list[int]]:
    """Four prompts: corpus text of 13, 6 and 1 tokens (structured: drafts get accepted) and a random one."""
    corpus = Corpus.load(DATA / name)
    x = corpus.sample(3, 13, seed=2024).tolist()
    g = torch.Generator().manual_seed(5)
    return [x[0], x[1][:6], x[2][:1], torch.randint(1, corpus.vocab_size - 1, (9,), generator=g).tolist()]


V4_CFG = v4.DeepseekV4Config.tiny()  # 3 layers: sliding (window 8), CSA (every 4, top-3), HCA (every 16); n_hc = 2


@functools.cache
def v4_target() -> dict:
    """The float64 tiny V4 target, random-init (std 0.02: its greedy continuations recur in phrases, which a
    head can learn)."""
    return {n: t.double() if t.is_floating_point() else t for n, t in v4.init_params(V4_CFG, seed=1, std=0.02).items()}


@functools.cache
def v4_trained():
    """(float64 DSpark head, losses, per-slot accuracy): block 4, self-distilled on 32 greedy continuations
    of random 4-token prompts to 24 tokens (60 steps, ~1.5 s)."""
    from cpattn.drafters.dspark import DSparkDrafter
    from cpattn.lab.train import hidden_layers_of, train_drafter

    params = v4_target()
    ps = torch.randint(1, V4_CFG.vocab_size - 1, (32, 4), generator=torch.Generator().manual_seed(0))
    data = tg.greedy_data("deepseek_v4", params, V4_CFG, ps, 24, hidden_layers_of("dspark", V4_CFG))
    d, losses, acc = train_drafter("dspark", "deepseek_v4", V4_CFG, params, data, seconds=0, seed=0, block_size=4,
                                   batch=8, lr=1e-2, max_steps=60)
    return DSparkDrafter({n: t.double() for n, t in d.params.items()}, d.cfg), losses, acc


def v4_prompts() -> list[list[int]]:
    """Four prompts of 13, 6, 1 and 20 tokens (shorter and longer than V4's window and HCA ratio)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, V4_CFG.vocab_size - 1, (n,), generator=g).tolist() for n in (13, 6, 1, 20)]


def check_lossless(out, ref, k: int, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """A speculative run ``out`` emitted plain greedy's tokens (and logits) ``ref``, its counters add up, and
    drafts were both accepted and rejected (so every rollback path ran)."""
    assert torch.equal(out.tokens, ref.tokens)
    assert torch.allclose(out.logits.double(), ref.logits.double(), rtol=rtol, atol=atol)
    s = out.stats
    assert s.drafted == k * s.rows and s.emitted == s.accepted + s.rows and sum(s.accepted_hist) == s.rows
    assert 0 < s.accepted < s.drafted, "trained heads get drafts accepted, and rejected (rollbacks run)"


def same_on_every_rank(outs) -> None:
    """Every rank's run emitted the same tokens from the same drafts (replicated drafter, logical PCP 1)."""
    for o in outs[1:]:
        assert torch.equal(o.tokens, outs[0].tokens)
        assert o.stats.draft_digest == outs[0].stats.draft_digest, "replicated drafters proposed different drafts"


class Recorder:
    """A drafter that records every proposal of the states it starts: ``log`` of (histories, drafts) and
    ``states`` (the real draft states, to look at their runners)."""

    def __init__(self, drafter):
        self.drafter, self.log, self.states = drafter, [], []
        self.method, self.settings, self.hidden_layers = drafter.method, drafter.settings, drafter.hidden_layers

    def start(self, num_requests, max_len, *, graph=None):
        state = self.drafter.start(num_requests, max_len, graph=graph)
        self.states.append(state)
        return _Recording(state, self.log)


class _Recording:
    def __init__(self, state, log):
        self.state, self.log = state, log

    def propose(self, histories, k, requests, hidden=None):
        drafts = self.state.propose(histories, k, requests, hidden)
        self.log.append(([list(h) for h in histories], drafts.tolist()))
        return drafts

    def rollback(self, requests, keep_lens):
        self.state.rollback(requests, keep_lens)


def hidden_of(model: str, params: dict, cfg, seq: list[int], layers: tuple) -> dict:
    """The target's hidden states of a whole sequence, one dense prefill: ``{name: [S, H]}``."""
    fam = get_family(model)
    cache = DenseKVCache.empty(fam.kv_layouts(cfg), batch=1, max_len=len(seq),
                               dtype=params["model.embed_tokens.weight"].dtype)
    return fam.forward(params, cfg, torch.tensor(seq), cache.step([len(seq)]), hidden_layers=layers)[1]


def reference_drafts(drafter, model: str, params: dict, cfg, history: list[int], k: int) -> list[int]:
    """The k drafts ``drafter`` proposes after ``history``, recomputed from scratch (no cache, no rollback)."""
    hid = {n: h[: len(history) - 1] for n, h in hidden_of(model, params, cfg, history,
                                                         drafter.hidden_layers).items()}
    if drafter.method == "mtp":
        def layer(p, c, *a):
            return mt.mtp_logits_features(p, c, drafter.layer, *a)

        return sq.chain_reference(layer, drafter.params, mt.block_config(drafter.cfg), history, hid["norm"], k,
                                  rope_offset=1, mla_value_dim=drafter.cfg.kv_lora_rank)
    if drafter.method == "eagle3":
        return sq.chain_reference(e3.eagle3_layer, drafter.params, drafter.cfg, history,
                                  e3.fuse(drafter.params, drafter.cfg, hid), k, rope_offset=0,
                                  to_target=functools.partial(e3.to_target, drafter.params))
    feats = torch.cat([hid[i] for i in drafter.cfg.target_layer_ids], -1)
    return sq.dspark_reference(drafter.params, drafter.cfg, history, feats, k)[0]


def run_cases(group, cases):
    """Each case is (rank function, args, kwargs); returns each case's result (module level: spawn pickles it)."""
    return [fn(group, *a, **kw) for fn, a, kw in cases]
