"""The one-device reference: prefill and greedy decode on a dense cache, eager, no parallelism.

What every parallel run must reproduce (and what is itself checked against
Hugging Face ``transformers``): the plain path of DESIGN.md §5's oracles,
with none of the engine's sharding, hand-off or graph machinery. Timed per
phase so benchmarks can report single-device TTFT and TPOT beside it.

Example
-------
>>> from cpattn.models.family import get_family
>>> from cpattn.models import qwen3
>>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
>>> ref = reference_generate(get_family("qwen3"), qwen3.init_params(cfg), cfg, [[1, 2, 3], [4]], 4)
>>> ref.tokens.shape, ref.prompt_logits.shape
(torch.Size([2, 4]), torch.Size([4, 32]))
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.engine.batch import Prompts
from cpattn.engine.dense_cache import DenseKVCache
from cpattn.models.family import ModelFamily, get_family, param_dtype
from cpattn.engine.logits import as_logits


@dataclass(frozen=True)
class Reference:
    """tokens [B, N] int64; logits [B, N, V] (what each token was chosen from) and prompt_logits [T, V]
    in float32, float64 in a float64 run;
    prefill_s: the prefill's wall seconds; step_s: each decode step's; kv_bytes: the dense cache's storage."""

    tokens: torch.Tensor
    logits: torch.Tensor
    prompt_logits: torch.Tensor
    prefill_s: float
    step_s: list[float]
    kv_bytes: int


def reference_generate(model: ModelFamily | str, params: dict, cfg: Any, prompts, max_new_tokens: int) -> Reference:
    """``max_new_tokens`` greedy tokens per prompt on one device (ties go to the lowest token id)."""
    family = get_family(model)
    p = prompts if isinstance(prompts, Prompts) else Prompts.of(prompts)
    dtype = param_dtype(params)
    steps = max_new_tokens - 1
    cache = DenseKVCache.empty(family.kv_layouts(cfg), batch=p.num_requests, max_len=max(p.prompt_lens) + steps,
                               dtype=dtype, device=p.tokens.device)
    t0 = time.perf_counter()
    step = cache.step(list(p.prompt_lens))
    prompt_logits = as_logits(family.forward(params, cfg, p.tokens, step))  # [T, V]
    cache = step.finish()
    first_logits = prompt_logits[torch.tensor(p.cu_seqlens[1:]) - 1]  # [B, V]
    tok = first_logits.argmax(-1)
    prefill_s = time.perf_counter() - t0
    toks, logits, times = [tok], [first_logits], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step = cache.step([1] * p.num_requests)
        out = as_logits(family.forward(params, cfg, tok, step))  # [B, V]
        cache = step.finish()
        tok = out.argmax(-1)
        times.append(time.perf_counter() - t0)
        toks.append(tok)
        logits.append(out)
    return Reference(torch.stack(toks, 1), torch.stack(logits, 1), prompt_logits, prefill_s, times, cache.kv_bytes())
