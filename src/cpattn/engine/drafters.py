"""Drafters for speculative decoding, all behind one protocol and one registry (:data:`DRAFTERS`).

A *drafter* is a picklable description (weights included) with three
declarations and one call:

- ``method``: its name as ``SpeculativeConfig.speculative_method`` ("ngram",
  "draft_model", "mtp", "eagle3", "dspark"): the guide's rules with PCP
  see it (MTP for MLA/DSA, Eagle3 for GQA, DSpark for DSA: compatibility
  notes, refusals with ``strict_guide=True``; docs/compat.md);
- ``settings``: its :class:`DraftSettings` (draft sampling, draft attention,
  adaptive verification, dynamic draft length), routed into the engine's
  :class:`~cpattn.config.SpeculativeConfig` so the guide's constraints with
  PCP see them too (:func:`speculative_fields`); :func:`check_drafter`
  refuses what cpattn's drafters do not implement, under every layout;
- ``hidden_layers``: None for a drafter that reads tokens only, else the
  target hidden states it reads -- a tuple of layer indices (possibly
  empty); ``"norm"`` (the final-normed state) always comes with them;
- ``start(num_requests, max_len, *, graph=None)`` -> the per-rank *draft
  state*; ``graph`` names a graph backend for the drafter's own steps
  (FULL_DECODE_ONLY), None for eager.

Every rank of a DCP group runs its own state on the same histories and
hidden states and gets the same drafts (the guide's draft replicated on
every rank, with logical PCP size 1), so drafts are never communicated.
Draft sampling is greedy.

The draft state's two calls, once per verification step each:

- ``propose(histories, k, requests, hidden=None) -> [A, k] int64``:
  ``histories[i]`` is request ``requests[i]``'s token history (prompt and
  every token generated so far; the last one is not in the target's KV
  cache yet). ``hidden`` (a :class:`TargetHidden`, for drafters that declare
  ``hidden_layers``) holds the target's hidden states of the rows it
  computed since the previous call -- the prompt after prefill, the 1 + k
  verified rows after a step -- of which the leading ``valid`` rows are
  final (the rest were computed on rejected drafts and must not be used).
  Always exactly k tokens per request, so every verification batch is
  uniform (1 + k rows per request, as graph capture needs).
- ``rollback(requests, keep_lens)``: after verification the first
  ``keep_lens[i]`` tokens of request ``requests[i]`` are final (the target
  cache holds them); the state drops whatever it holds past them (rejected
  drafts, and the draft's own cache rows built on them).

Example
-------
>>> d = NgramDrafter(max_ngram=2).start(num_requests=1, max_len=32)
>>> d.propose([[5, 6, 7, 1, 5, 6]], 3, [0]).tolist()
[[7, 1, 5]]
>>> sorted(DRAFTERS)
['draft_model', 'dspark', 'eagle3', 'mtp', 'ngram']
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

import torch

from cpattn.engine.dense_cache import DenseKVCache
from cpattn.engine.family import ModelFamily, get_family, param_dtype
from cpattn.engine.logits import as_logits


@dataclass(frozen=True)
class DraftSettings:
    """How a drafter drafts, as the engine's ``SpeculativeConfig`` names it (the guide's PCP constraints).

    draft_sampling: "greedy" (the only one cpattn's drafters implement);
    draft_attention: None (dense) or a backend name ("sfa": sparse, refused
    with PCP); adaptive_verification, dynamic_draft_length: verification
    schedules the guide does not support (or validate) with PCP; cpattn
    always verifies a fixed k.

    >>> DraftSettings().draft_sampling
    'greedy'
    """

    draft_sampling: str = "greedy"
    draft_attention: str | None = None
    adaptive_verification: bool = False
    dynamic_draft_length: bool = False


def speculative_fields(drafter) -> dict:
    """The ``SpeculativeConfig`` fields of a run with ``drafter``: its method and settings (flat names).

    >>> speculative_fields(NgramDrafter())["speculative_method"]
    'ngram'
    """
    return {"speculative_method": drafter.method, **dataclasses.asdict(drafter.settings)}


@dataclass(frozen=True)
class TargetHidden:
    """Target hidden states of some rows of each request, the input of drafters that read them.

    rows: ``{name: [A, Q, F]}`` (names as the family's ``hidden``: layer
    indices and "norm"); row j of request i is the hidden state at position
    ``start[i] + j``, its trailing dims flattened into F features (H for a
    ``[T, H]`` residual stream; ``n_hc * H`` for DeepSeek-V4's ``[T, n_hc, H]``
    hyper-connection streams); only its leading ``valid[i]`` rows are final
    (the rest were computed on rejected drafts, or are padding).

    Example
    -------
    >>> h = TargetHidden.packed({"norm": torch.arange(10.0).view(5, 2)}, [0, 3, 5], [0, 4])
    >>> h.rows["norm"].shape, h.start, h.valid
    (torch.Size([2, 3, 2]), (0, 4), (3, 2))
    >>> h.take([1]).rows["norm"][0, :2].tolist()
    [[6.0, 7.0], [8.0, 9.0]]
    >>> TargetHidden.packed({0: torch.zeros(5, 2, 3)}, [0, 3, 5], [0, 0]).rows[0].shape   # [T, n_hc, H] streams
    torch.Size([2, 3, 6])
    """

    rows: dict
    start: tuple[int, ...]
    valid: tuple[int, ...]

    @classmethod
    def packed(cls, hidden: dict, cu_seqlens: list[int], start: list[int]) -> TargetHidden:
        """From packed request-order rows ``{name: [T, ...]}`` (a prefill's) and ``cu_seqlens`` [B+1]:
        request b's rows are positions ``start[b] ..``, all final (padded to the longest; trailing dims
        flattened)."""
        lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        q = max(lens, default=0)
        rows = {}
        for name, h in hidden.items():
            h = h.reshape(h.shape[0], -1)  # [T, F]
            out = h.new_zeros(len(lens), q, h.shape[-1])  # [B, Q, F]
            for b, (a, n) in enumerate(zip(cu_seqlens, lens)):
                out[b, :n] = h[a : a + n]
            rows[name] = out
        return cls(rows, tuple(int(s) for s in start), tuple(lens))

    def take(self, index: list[int]) -> TargetHidden:
        """The rows of requests ``index`` (positions in this object's request order)."""
        idx = torch.tensor(index, dtype=torch.int64)
        return TargetHidden({n: h[idx] for n, h in self.rows.items()}, tuple(self.start[i] for i in index),
                            tuple(self.valid[i] for i in index))


class DraftState(Protocol):
    """Per-rank drafting state (see module doc)."""

    def propose(self, histories: list[list[int]], k: int, requests: list[int],
                hidden: TargetHidden | None = None) -> torch.Tensor: ...

    def rollback(self, requests: list[int], keep_lens: list[int]) -> None: ...


class Drafter(Protocol):
    """A picklable drafter description (see module doc)."""

    method: str
    settings: DraftSettings
    hidden_layers: tuple | None

    def start(self, num_requests: int, max_len: int, *, graph: str | None = None) -> DraftState: ...


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
    settings: DraftSettings = DraftSettings()
    method: ClassVar[str] = "ngram"
    hidden_layers: ClassVar[None] = None

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram; got min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
            )

    def start(self, num_requests: int, max_len: int, *, graph: str | None = None) -> NgramDrafter:
        """This drafter (it keeps no state; a host-side lookup, nothing to capture)."""
        return self

    def propose(self, histories: list[list[int]], k: int, requests: list[int],
                hidden: TargetHidden | None = None) -> torch.Tensor:
        """k draft tokens per history: [A, k] int64 (``requests`` and ``hidden`` are unused)."""
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


class Registry(Mapping):
    """Drafter name -> class, importing a method's module on first use (its weights code is not free).

    >>> DRAFTERS["ngram"] is NgramDrafter, "mtp" in DRAFTERS
    (True, True)
    """

    def __init__(self, entries: dict[str, type | str]):
        self._entries = dict(entries)

    def __getitem__(self, name: str) -> type:
        if name not in self._entries:
            raise KeyError(f"unknown drafter {name!r}; known: {sorted(self._entries)}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module, cls = entry.split(":")
            entry = self._entries[name] = getattr(importlib.import_module(module), cls)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


# name -> drafter class; a drafter is built as DRAFTERS[name](**its arguments) or DRAFTERS[name].from_checkpoint(dir)
DRAFTERS = Registry({
    "ngram": NgramDrafter,
    "draft_model": ModelDrafter,
    "mtp": "cpattn.drafters.mtp:MTPDrafter",
    "eagle3": "cpattn.drafters.eagle3:Eagle3Drafter",
    "dspark": "cpattn.drafters.dspark:DSparkDrafter",
})


def check_drafter(drafter, num_speculative_tokens: int, *, settings: bool = True) -> None:
    """Raise for a drafter that does not follow the protocol, a k < 1 with a drafter, or (``settings``)
    settings cpattn's drafters do not implement. The driver checks settings after the engine configs
    passed the guide's rules, so with PCP the guide's refusal (and its fix) comes first; entry points
    that check before building their configs pass ``settings=False``.

    >>> check_drafter(NgramDrafter(settings=DraftSettings(draft_sampling="random")), 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: draft_sampling: saw 'random'; rule: cpattn's drafters draft greedily; fix: draft_sampling='greedy'
    """
    if drafter is None:
        return
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1 with a drafter; got {num_speculative_tokens!r}")
    missing = [a for a in ("start", "method", "settings", "hidden_layers") if not hasattr(drafter, a)]
    if missing or not callable(drafter.start):
        raise TypeError(f"a drafter must have .start(num_requests, max_len) returning a state with .propose and "
                        f".rollback, a .method name, .settings (DraftSettings) and .hidden_layers (see "
                        f"cpattn.engine.drafters); {type(drafter).__name__} lacks {missing or ['a callable start']}")
    if not settings:
        return
    s = drafter.settings
    if s.draft_sampling != "greedy":
        raise ValueError(f"draft_sampling: saw {s.draft_sampling!r}; rule: cpattn's drafters draft greedily; "
                         "fix: draft_sampling='greedy'")
    if s.draft_attention not in (None, "dense"):
        raise ValueError(f"draft_attention: saw {s.draft_attention!r}; rule: cpattn's drafters attend densely over "
                         "their own cache; fix: draft_attention=None")
    if s.adaptive_verification or s.dynamic_draft_length:
        which = "adaptive_verification" if s.adaptive_verification else "dynamic_draft_length"
        raise ValueError(f"{which}: saw True; rule: cpattn verifies a fixed k drafts per step (uniform steps for "
                         f"graph capture); fix: {which}=False")
