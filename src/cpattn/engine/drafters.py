"""The drafter protocol of speculative decoding (the drafters themselves, and their registry
:data:`cpattn.drafters.registry.DRAFTERS`, live in :mod:`cpattn.drafters`).

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

The two drafters that need no weights file of their own are n-gram prompt
lookup (:mod:`cpattn.drafters.ngram`) and a draft model
(:mod:`cpattn.drafters.draft_model`). Their names, ``DRAFTERS`` and
``Registry`` read from here are deprecated aliases (:mod:`cpattn.engine._drafters_moved`).

Example
-------
>>> from cpattn.drafters.ngram import NgramDrafter
>>> d = NgramDrafter(max_ngram=2).start(num_requests=1, max_len=32)
>>> d.propose([[5, 6, 7, 1, 5, 6]], 3, [0]).tolist()
[[7, 1, 5]]
>>> check_drafter(NgramDrafter(), 3)  # the protocol and the settings cpattn implements: no error
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch


def __getattr__(name: str):
    from cpattn.engine import _drafters_moved  # the deprecated names (they moved to cpattn.drafters)

    if name in _drafters_moved.MOVED:
        return _drafters_moved.resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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

    >>> from cpattn.drafters.ngram import NgramDrafter
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



def check_drafter(drafter, num_speculative_tokens: int, *, settings: bool = True) -> None:
    """Raise for a drafter that does not follow the protocol, a k < 1 with a drafter, or (``settings``)
    settings cpattn's drafters do not implement. The driver checks settings after the engine configs
    passed the guide's rules, so with PCP the guide's refusal (and its fix) comes first; entry points
    that check before building their configs pass ``settings=False``.

    >>> from cpattn.drafters.ngram import NgramDrafter
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
