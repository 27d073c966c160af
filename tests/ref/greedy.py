"""The one-device greedy recompute: the tests' token oracle for whole models of every family.

Each next token is the argmax (ties: the lowest id, ``torch.argmax``'s rule) of the LAST row of a fresh
one-device full prefill of the prompt and the tokens chosen so far. No KV cache, recurrent state or ring is
carried from one token to the next, nothing is sharded, and no step loop, scheduler, runner, backend,
hand-off or drafter runs: each prefill is the family's own ``forward`` over a freshly built, empty one-device
attention state --

- paged families (Qwen3, Qwen3-MoE, DeepSeek-V2/V3/V3.2, GLM-5): a :class:`cpattn.engine.dense_cache.DenseKVCache`
  step of the whole sequence;
- hybrid families (Qwen3-Next, Qwen3.5): the same, plus the linear layers' zero states
  (``family.recurrent_cache(...).step([L])``);
- DeepSeek-V4: a :class:`cpattn.v4.step.V4Step` of the whole sequence over an empty one-device ``V4Cache``.

So it shares with the engine only the model's forward (its layers and its one-device attention), which is
itself checked against Hugging Face ``transformers`` (tests/test_models_hf.py, test_qwen3_next_hf.py,
test_v4_model_hf.py, ...), never ``cpattn.engine.generate``'s step loop that many of the engine tests compare.
This is the one module of :mod:`ref` that imports cpattn (the others are written without it). It costs one
prefill per token, which on the tests' tiny models is milliseconds; :class:`OneDevice` memoizes it per
session (``conftest.py``'s ``one_device`` fixture). The tests' models are float64, so greedy ties do not occur
in practice (DESIGN.md §5).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch


def _family(family):
    from cpattn.models.family import get_family

    return get_family(family)


def _dtype(params: dict) -> torch.dtype:
    """The params' widest floating dtype (V4 keeps some tensors float32 in a float64 model)."""
    fl = [t.dtype for t in params.values() if t.is_floating_point()]
    return torch.float64 if torch.float64 in fl else fl[0]


def full_prefill(family, params: dict, cfg: Any, tokens: list[int]) -> torch.Tensor:
    """Logits [L, V] of every position of one one-device full prefill of ``tokens`` (L >= 1), from empty state."""
    fam = _family(family)
    n, dtype = len(tokens), _dtype(params)
    ids = torch.tensor(list(tokens), dtype=torch.int64)
    with torch.no_grad():
        if fam.cache == "v4":
            from cpattn.v4.cache import V4Cache
            from cpattn.v4.step import V4Step

            cache = V4Cache.empty(cfg.layout(), batch=1, max_len=n, dtype=dtype)
            out = fam.forward(params, cfg, ids, V4Step(cache, [n]))
        else:
            from cpattn.engine.dense_cache import DenseKVCache

            step = DenseKVCache.empty(fam.kv_layouts(cfg), batch=1, max_len=n, dtype=dtype).step([n])
            if fam.cache == "hybrid":
                lin = fam.recurrent_cache(cfg, batch=1, dtype=dtype).step([n])
                out = fam.forward(params, cfg, ids, step, lin)
            else:
                out = fam.forward(params, cfg, ids, step)
    assert out.shape[0] == n, (fam.name, tuple(out.shape), n)
    return out if out.dtype == torch.float64 else out.float()


def recompute(family, params: dict, cfg: Any, prompt: list[int],
              n: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(n greedy tokens, the logits [n, V] each was chosen from, the prompt's logits [len(prompt), V])."""
    toks, rows, prompt_logits = list(prompt), [], None
    for _ in range(n):
        logits = full_prefill(family, params, cfg, toks)
        if prompt_logits is None:
            prompt_logits = logits
        rows.append(logits[-1])
        toks.append(int(logits[-1].argmax()))
    if prompt_logits is None:
        prompt_logits = full_prefill(family, params, cfg, toks)
    v = prompt_logits.shape[-1]
    return toks[len(prompt):], torch.stack(rows) if rows else prompt_logits.new_zeros(0, v), prompt_logits


def recompute_greedy(family, params: dict, cfg: Any, prompt: list[int], n: int) -> list[int]:
    """The n greedy tokens after ``prompt``: each the argmax of the last row of a full one-device prefill."""
    return recompute(family, params, cfg, prompt, n)[0]


@dataclass(frozen=True)
class Greedy:
    """A batch's recompute: tokens [B, N] int64, logits [B, N, V] (what each token was chosen from),
    prompt_logits [sum of prompt lengths, V] (every prompt token's, request order); ``rows(b)``: request b's
    tokens as a list."""

    tokens: torch.Tensor
    logits: torch.Tensor
    prompt_logits: torch.Tensor

    def rows(self, b: int = 0) -> list[int]:
        return self.tokens[b].tolist()


def params_digest(params: dict) -> str:
    """A content hash of ``params`` (names, dtypes, shapes, bytes): equal weights, equal key, however built."""
    h = hashlib.sha1()
    for k in sorted(params):
        t = params[k].detach().contiguous().cpu()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class OneDevice:
    """The memoizing one-device greedy oracle: ``one_device(family, params, cfg, prompts, n) -> Greedy``.

    The cache key is honest: (family name, ``repr(cfg)``, a content hash of ``params``, the prompt), so two
    tests share an entry only when their weights are bit-equal, and a parameter changed in place gets a new
    entry. Per prompt it keeps the longest run recomputed so far and extends it on demand (greedy tokens are
    prefix-stable: the first m of n are the m-token answer).
    """

    def __init__(self):
        self._runs: dict = {}  # key -> [tokens list, logits rows list, prompt_logits]
        self.prefills = 0  # full prefills run (the cost)

    def __call__(self, family, params: dict, cfg: Any, prompts, n: int) -> Greedy:
        fam = _family(family)
        prompts = [list(map(int, p)) for p in prompts]
        model = (fam.name, repr(cfg), params_digest(params))
        toks, logits, plog = [], [], []
        for p in prompts:
            t, l, pl = self._extend(model, fam, params, cfg, p, n)
            toks.append(torch.tensor(t[:n], dtype=torch.int64))
            logits.append(torch.stack(l[:n]) if n else pl.new_zeros(0, pl.shape[-1]))
            plog.append(pl)
        return Greedy(torch.stack(toks), torch.stack(logits), torch.cat(plog))

    def tokens(self, family, params: dict, cfg: Any, prompt, n: int) -> list[int]:
        """One prompt's n greedy tokens."""
        return self(family, params, cfg, [prompt], n).rows(0)

    def _extend(self, model, fam, params, cfg, prompt: list[int], n: int):
        key = model + (tuple(prompt),)
        run = self._runs.get(key)
        if run is None:
            plog = full_prefill(fam, params, cfg, prompt)
            self.prefills += 1
            run = self._runs[key] = [[int(plog[-1].argmax())], [plog[-1]], plog]
        toks, rows, _ = run
        while len(toks) < n:
            logits = full_prefill(fam, params, cfg, prompt + toks)
            self.prefills += 1
            rows.append(logits[-1])
            toks.append(int(logits[-1].argmax()))
        return run


ONE_DEVICE = OneDevice()  # the process's one memo: conftest.py's session fixture, and helpers imported across test files
