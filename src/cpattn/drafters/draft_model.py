"""The draft-model drafter: a small model of the target's family, greedy, with its own dense KV cache.

A :class:`~cpattn.engine.drafters.Drafter` of method "draft_model";
:func:`truncated` builds one from the target's first layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from cpattn.engine.dense_cache import DenseKVCache
from cpattn.engine.drafters import DraftSettings, TargetHidden
from cpattn.models.family import ModelFamily, get_family, param_dtype
from cpattn.engine.logits import as_logits


@dataclass(frozen=True)
class ModelDrafter:
    """A small model of the target's family, greedy, on one device (logical PCP size 1).

    ``model``: a :class:`~cpattn.models.family.ModelFamily` or family name;
    ``params`` / ``cfg`` its weights and config (same vocabulary as the
    target). :func:`truncated` builds one from the target's first layers.
    """

    model: ModelFamily | str
    params: dict
    cfg: Any
    settings: DraftSettings = DraftSettings()
    method: ClassVar[str] = "draft_model"
    hidden_layers: ClassVar[None] = None

    def start(self, num_requests: int, max_len: int, *, graph: str | None = None) -> ModelDraftState:
        """Fresh per-rank state: a dense KV cache of ``num_requests`` rows x ``max_len`` tokens
        (its steps run eagerly whatever ``graph`` says: the dense cache plans on the host)."""
        return ModelDraftState(self, num_requests, max_len)


class ModelDraftState:
    """The draft model's KV cache and the tokens it holds, per request.

    propose: feed each request's history past what the cache holds in one
    step, then k - 1 single-token steps; the cache then holds history +
    drafts[:k-1]. rollback: keep only the final tokens (rejected drafts' rows
    are dropped by length and overwritten later).
    """

    def __init__(self, drafter: ModelDrafter, num_requests: int, max_len: int):
        self.family = get_family(drafter.model)
        self.params, self.cfg = drafter.params, drafter.cfg
        self.cache = DenseKVCache.empty(self.family.kv_layouts(self.cfg), batch=num_requests, max_len=max_len,
                                        dtype=param_dtype(self.params))
        self.held: list[list[int]] = [[] for _ in range(num_requests)]

    def propose(self, histories: list[list[int]], k: int, requests: list[int],
                hidden: TargetHidden | None = None) -> torch.Tensor:
        """k greedy draft tokens for each request in ``requests`` (histories in the same order): [A, k]."""
        if k == 0:
            return torch.zeros(len(requests), 0, dtype=torch.int64)
        if list(requests) != sorted(set(requests)):
            raise ValueError(f"requests must be distinct and ascending (cache row order); got {requests}")
        b = len(self.held)
        lens = list(self.cache.seq_lens)
        feed, new = [], [0] * b
        for r, h in zip(requests, histories):
            c = _common_prefix(self.held[r], h, len(h) - 1)  # keep >= 1 token to feed
            lens[r] = c
            self.held[r] = list(h)
            feed.extend(h[c:])
            new[r] = len(h) - c
        self.cache = self.cache.truncate(lens)
        last = torch.tensor(new).cumsum(0)[torch.tensor(requests)] - 1  # [A] each request's last fed row
        tok = self._step(torch.tensor(feed, dtype=torch.int64), new, last)  # [A]
        drafts = [tok]
        for _ in range(k - 1):
            ones = [0] * b
            for r in requests:
                ones[r] = 1
            tok = self._step(tok, ones, torch.arange(len(requests)))
            drafts.append(tok)
        for i, r in enumerate(requests):
            self.held[r].extend(int(d[i]) for d in drafts[:-1])
        return torch.stack(drafts, 1)  # [A, k]

    def rollback(self, requests: list[int], keep_lens: list[int]) -> None:
        """Forget cache rows past the first ``keep_lens[i]`` tokens of each request."""
        lens = list(self.cache.seq_lens)
        for r, n in zip(requests, keep_lens):
            lens[r] = min(lens[r], n)
            del self.held[r][lens[r]:]
        self.cache = self.cache.truncate(lens)

    def _step(self, tokens: torch.Tensor, new_lens: list[int], last: torch.Tensor) -> torch.Tensor:
        step = self.cache.step(new_lens)
        logits = as_logits(self.family.forward(self.params, self.cfg, tokens, step, logits_index=last))  # [A, V]
        self.cache = step.finish()
        return logits.argmax(-1)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def truncated(model: ModelFamily | str, params: dict, cfg: Any, num_layers: int = 1) -> ModelDrafter:
    """A draft model made of the target's first ``num_layers`` layers, its final norm and head.

    Example
    -------
    >>> # drafter = truncated("qwen3", params, cfg, num_layers=1)
    """
    if not 1 <= num_layers <= cfg.num_hidden_layers:
        raise ValueError(f"num_layers must be in [1, {cfg.num_hidden_layers}]; got {num_layers}")
    keep = {n: t for n, t in params.items()
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < num_layers}
    return ModelDrafter(model, keep, replace(cfg, num_hidden_layers=num_layers))
