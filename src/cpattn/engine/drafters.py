"""Drafters for speculative decoding, all behind one protocol and one registry (:data:`DRAFTERS`).

A *drafter* is a picklable description (weights included); ``start(num_requests,
max_len)`` gives the per-rank *draft state*. Every rank of a DCP group runs
its own state on the same histories and gets the same drafts (the guide's
draft model replicated on every rank, with logical PCP size 1), so drafts
are never communicated. Draft sampling is greedy.

The draft state's two calls, once per verification step each:

- ``propose(histories, k, requests) -> [A, k] int64``: ``histories[i]`` is
  request ``requests[i]``'s token history (prompt and every token generated
  so far; the last one is not in the target's KV cache yet). Always exactly
  k tokens per request, so every verification batch is uniform (1 + k rows
  per request, as graph capture needs).
- ``rollback(requests, keep_lens)``: after verification the first
  ``keep_lens[i]`` tokens of request ``requests[i]`` are final (the target
  cache holds them); the state drops whatever it holds past them (rejected
  drafts).

A drafter that reads the target's hidden states declares them in
``hidden_layers`` (None here: n-gram and draft-model drafters read tokens only).

Example
-------
>>> d = NgramDrafter(max_ngram=2).start(num_requests=1, max_len=32)
>>> d.propose([[5, 6, 7, 1, 5, 6]], 3, [0]).tolist()
[[7, 1, 5]]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from cpattn.engine.dense_cache import DenseKVCache
from cpattn.engine.family import ModelFamily, get_family


class DraftState(Protocol):
    """Per-rank drafting state (see module doc)."""

    def propose(self, histories: list[list[int]], k: int, requests: list[int]) -> torch.Tensor: ...

    def rollback(self, requests: list[int], keep_lens: list[int]) -> None: ...


class Drafter(Protocol):
    """A picklable drafter description (see module doc)."""

    hidden_layers: tuple | None

    def start(self, num_requests: int, max_len: int) -> DraftState: ...


# -- n-gram prompt lookup ------------------------------------------------------------


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the history's last n tokens, propose what followed.

    Tries n = ``max_ngram`` down to ``min_ngram``; the first n with a match
    wins. No match: the draft repeats the last token (cheap to reject).
    Stateless, so :meth:`start` returns itself.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    hidden_layers = None

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram; got min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
            )

    def start(self, num_requests: int, max_len: int) -> NgramDrafter:
        """This drafter (it keeps no state)."""
        return self

    def propose(self, histories: list[list[int]], k: int, requests: list[int]) -> torch.Tensor:
        """k draft tokens per history: [A, k] int64 (``requests`` is unused)."""
        return torch.tensor([ngram_lookup(h, k, self.max_ngram, self.min_ngram) for h in histories],
                            dtype=torch.int64).view(len(histories), k)

    def rollback(self, requests: list[int], keep_lens: list[int]) -> None:
        """Nothing to drop: the lookup reads the histories only."""


def ngram_lookup(history: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The k tokens that followed the latest earlier match of ``history``'s last n tokens.

    history: [S] token ids (S >= 1). Returns exactly k ids, padded with the
    last one found (or the history's last token when nothing matches).

    Example
    -------
    >>> ngram_lookup([1, 2, 3, 9, 1, 2], 2)
    [3, 9]
    >>> ngram_lookup([4, 5], 2)
    [5, 5]
    """
    s = len(history)
    for n in range(min(max_ngram, s - 1), min_ngram - 1, -1):
        tail = history[s - n :]
        for start in range(s - n - 1, -1, -1):  # latest match first; it must end before the tail does
            if history[start : start + n] == tail:
                found = history[start + n : start + n + k]
                return found + [found[-1]] * (k - len(found))
    return [history[-1]] * k


# -- draft model ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelDrafter:
    """A small model of the target's family, greedy, on one device (logical PCP size 1).

    ``model``: a :class:`~cpattn.engine.family.ModelFamily` or family name;
    ``params`` / ``cfg`` its weights and config (same vocabulary as the
    target). :func:`truncated` builds one from the target's first layers.
    """

    model: ModelFamily | str
    params: dict
    cfg: Any
    hidden_layers = None

    def start(self, num_requests: int, max_len: int) -> ModelDraftState:
        """Fresh per-rank state: a dense KV cache of ``num_requests`` rows x ``max_len`` tokens."""
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
        dtype = next(iter(self.params.values())).dtype
        self.cache = DenseKVCache.empty(self.family.kv_layouts(self.cfg), batch=num_requests, max_len=max_len,
                                        dtype=dtype)
        self.held: list[list[int]] = [[] for _ in range(num_requests)]

    def propose(self, histories: list[list[int]], k: int, requests: list[int]) -> torch.Tensor:
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
        logits = self.family.forward(self.params, self.cfg, tokens, step, logits_index=last).float()  # [A, V]
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


# name -> drafter class; a drafter is built as DRAFTERS[name](**its arguments)
DRAFTERS: dict[str, type] = {"ngram": NgramDrafter, "draft_model": ModelDrafter}


def check_drafter(drafter, num_speculative_tokens: int) -> None:
    """Raise for a drafter that does not follow the protocol, or a k < 1 with a drafter."""
    if drafter is None:
        return
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1 with a drafter; got {num_speculative_tokens!r}")
    if not callable(getattr(drafter, "start", None)):
        raise TypeError(f"a drafter must have .start(num_requests, max_len) returning a state with .propose and "
                        f".rollback (see cpattn.engine.drafters); got {type(drafter).__name__}")
