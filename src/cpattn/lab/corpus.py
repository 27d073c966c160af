"""A small synthetic corpus with structure, so that a tiny target's continuations are predictable.

Text is a walk over *phrases* (fixed token sequences of 2..6 tokens drawn
from a small vocabulary, tokens shared between phrases): the next phrase
depends on the previous two (a second-order chain with three successors
of probabilities 0.6 / 0.25 / 0.15). Inside a phrase the next token is
determined once the phrase is recognised; at a boundary a model must know
the last two phrases to pick the likely successor. A target trained on
it continues greedily along the likeliest walk -- predictable several
tokens ahead, which is what drafters exploit -- while the shared tokens
and the second-order choice keep the prediction non-trivial.

Token 0 is never used; the last ``reserved`` ids of the vocabulary are
kept free (DSpark's placeholder token).

Example
-------
>>> c = Corpus.make(vocab_size=64, seed=0)
>>> x = c.sample(2, 20, seed=1)
>>> x.shape, int(x.min()) >= 1, int(x.max()) < 63
(torch.Size([2, 20]), True, True)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

PROBS = (0.6, 0.25, 0.15)


@dataclass(frozen=True)
class Corpus:
    """phrases: token lists; successors[(i, j)] after phrases i then j: three phrase ids (likeliest first),
    drawn with probabilities ``probs``."""

    vocab_size: int
    phrases: tuple[tuple[int, ...], ...]
    successors: tuple[tuple[int, ...], ...]  # flattened: entry i * n + j
    probs: tuple[float, ...] = PROBS

    @classmethod
    def make(cls, vocab_size: int, seed: int, num_phrases: int = 16, reserved: int = 1,
             probs: tuple[float, ...] = PROBS) -> Corpus:
        """A random corpus over tokens ``1 .. vocab_size - 1 - reserved``; ``probs`` of the successors (near
        ties, e.g. (0.36, 0.33, 0.31), make the target's choice at a phrase boundary hard to predict)."""
        g = torch.Generator().manual_seed(seed)
        top = vocab_size - reserved
        phrases = []
        for _ in range(num_phrases):
            n = int(torch.randint(2, 7, (1,), generator=g))
            phrases.append(tuple(int(t) for t in torch.randint(1, top, (n,), generator=g)))
        succ = tuple(tuple(int(s) for s in torch.randperm(num_phrases, generator=g)[: len(probs)])
                     for _ in range(num_phrases * num_phrases))
        return cls(vocab_size, tuple(phrases), succ, tuple(float(p) for p in probs))

    def sample(self, n: int, length: int, seed: int) -> torch.Tensor:
        """n token sequences of ``length`` tokens: [n, length] int64 (walks cut at length)."""
        g = torch.Generator().manual_seed(seed)
        probs = torch.tensor(self.probs)
        m = len(self.phrases)
        out = []
        for _ in range(n):
            a, b = (int(x) for x in torch.randint(0, m, (2,), generator=g))
            toks = list(self.phrases[a]) + list(self.phrases[b])
            while len(toks) < length + 7:
                c = self.successors[a * m + b][int(torch.multinomial(probs, 1, generator=g))]
                toks += self.phrases[c]
                a, b = b, c
            start = int(torch.randint(0, len(self.phrases[0]) + 1, (1,), generator=g))  # not always at a phrase start
            toks = toks[start : start + length]
            out.append(toks)
        return torch.tensor(out, dtype=torch.int64)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``corpus.json`` into directory ``path``."""
        with open(os.path.join(path, "corpus.json"), "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Corpus | None:
        """The ``corpus.json`` of directory ``path``, or None when there is none."""
        file = os.path.join(path, "corpus.json")
        if not os.path.isfile(file):
            return None
        with open(file) as f:
            d = json.load(f)
        return cls(d["vocab_size"], tuple(tuple(p) for p in d["phrases"]), tuple(tuple(s) for s in d["successors"]),
                   tuple(d.get("probs", PROBS)))
