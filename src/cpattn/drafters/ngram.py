"""The n-gram prompt-lookup drafter: propose what followed the latest earlier match of the history's tail.

It reads tokens only (no weights, no hidden states, no state), a
:class:`~cpattn.engine.drafters.Drafter` of method "ngram".

Example
-------
>>> d = NgramDrafter(max_ngram=2).start(num_requests=1, max_len=32)
>>> d.propose([[5, 6, 7, 1, 5, 6]], 3, [0]).tolist()
[[7, 1, 5]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from cpattn.engine.drafters import DraftSettings, TargetHidden


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
