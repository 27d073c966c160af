"""Shipped tiny trained targets and draft heads, prompts, a draft recorder and the no-cache draft references,
for the MTP / Eagle3 / DSpark tests (module level: spawned ranks import it by name).

tests/data/speculative holds (bfloat16 on disk, loaded in float64 or float32):

- ``qwen3`` / ``deepseek_v3``: tiny targets trained on the synthetic corpus (``cpattn train-target``);
- ``qwen3-eagle3``, ``qwen3-dspark``, ``deepseek_v3-mtp``, ``deepseek_v3-eagle3``, ``deepseek_v3-dspark``:
  heads trained by self-distillation on the target's greedy continuations (``cpattn train-draft``).
"""

from __future__ import annotations

import functools
import pathlib

import torch

from cpattn.drafters import eagle3 as e3
from cpattn.drafters import mtp as mt
from cpattn.drafters import sequence as sq
from cpattn.drafters import target as tg
from cpattn.drafters.corpus import Corpus
from cpattn.engine.dense_cache import DenseKVCache
from cpattn.engine.drafters import DRAFTERS
from cpattn.engine.family import get_family

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
