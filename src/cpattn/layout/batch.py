"""The engine's vocabulary for requests (vLLM's): prompts, query / context / sequence lengths.

``Prompts.prompt_lens[b]`` is request b's whole prompt (vLLM's ``num_prompt_tokens``).
For request b of a step: ``query_lens[b]`` new tokens are computed,
``context_lens[b]`` tokens are already in the KV cache before them, and
``seq_lens[b] = context_lens[b] + query_lens[b]``. A prefill's queries are
the prompt's tokens past its cached prefix; a decode step's are 1 (or
1 + k when verifying k drafts).

Example
-------
>>> p = Prompts.of([[5, 6, 7], [8]])
>>> p.tokens.tolist(), p.prompt_lens, p.cu_seqlens
([5, 6, 7, 8], (3, 1), [0, 3, 4])
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from cpattn.layout.rows import cu_seqlens


@dataclass(frozen=True, init=False)
class Prompts:
    """B prompts, packed: ``tokens`` [T] int64; request b is ``tokens[cu_seqlens[b]:cu_seqlens[b+1]]``.

    ``prompt_lens`` [B]: each whole prompt's length (``query_lens`` is its deprecated name: a step's
    query is only the part past a cached prefix, :meth:`suffix`).
    """

    tokens: torch.Tensor
    prompt_lens: tuple[int, ...]

    def __init__(self, tokens: torch.Tensor, prompt_lens: tuple[int, ...] | None = None, *,
                 query_lens: tuple[int, ...] | None = None):
        if query_lens is not None:
            if prompt_lens is not None:
                raise TypeError("Prompts() takes prompt_lens only; query_lens is its deprecated name, drop it")
            warnings.warn("Prompts(query_lens=) is deprecated; pass prompt_lens=", DeprecationWarning, stacklevel=2)
            prompt_lens = query_lens
        if prompt_lens is None:
            raise TypeError("Prompts() needs prompt_lens: one whole-prompt length per request")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "prompt_lens", prompt_lens)

    @property
    def query_lens(self) -> tuple[int, ...]:
        """Deprecated name of :attr:`prompt_lens` (whole prompts, not a step's new tokens)."""
        warnings.warn("Prompts.query_lens is deprecated (it holds whole prompts' lengths); use Prompts.prompt_lens",
                      DeprecationWarning, stacklevel=2)
        return self.prompt_lens

    @classmethod
    def of(cls, prompts, *, vocab_size: int | None = None) -> Prompts:
        """Pack a list of B token sequences (lists or 1-D int tensors, each non-empty).

        Raises ValueError naming the request and the rule for an empty batch,
        an empty or non-integer prompt, or a token id outside ``[0, vocab_size)``.
        """
        if isinstance(prompts, torch.Tensor) or not hasattr(prompts, "__len__") or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token sequences (one per request)")
        seqs = []
        for b, p in enumerate(prompts):
            t = torch.as_tensor(p)
            if t.numel() == 0:
                raise ValueError(f"prompt {b} is empty; every request needs at least one token")
            if t.is_floating_point() or t.dtype == torch.bool or t.dim() > 1:
                raise ValueError(f"prompt {b} must be a 1-D sequence of int token ids; got {t.dtype} {tuple(t.shape)}")
            t = t.to(torch.int64).flatten()
            if vocab_size is not None and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
                bad = int(t[(t < 0) | (t >= vocab_size)][0])
                raise ValueError(f"prompt {b} holds token id {bad}; token ids must be in [0, {vocab_size})")
            seqs.append(t)
        return cls(torch.cat(seqs), tuple(int(s.numel()) for s in seqs))

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)

    @property
    def cu_seqlens(self) -> list[int]:
        """[B+1] host ints."""
        return cu_seqlens(self.prompt_lens)

    def lists(self) -> list[list[int]]:
        """The prompts as B lists of ints."""
        cu = self.cu_seqlens
        return [self.tokens[a:b].tolist() for a, b in zip(cu, cu[1:])]

    def suffix(self, context_lens: tuple[int, ...]) -> Prompts:
        """The tokens past each request's first ``context_lens[b]`` (the part a prefill with a cached prefix computes).

        >>> Prompts.of([[1, 2, 3], [4, 5]]).suffix((2, 0)).tokens.tolist()
        [3, 4, 5]
        """
        if len(context_lens) != self.num_requests or any(c < 0 or c >= n for c, n in zip(context_lens, self.prompt_lens)):
            raise ValueError(f"context_lens {list(context_lens)} must leave every prompt of {list(self.prompt_lens)} "
                             "tokens at least one token to compute")
        cu = self.cu_seqlens
        return Prompts(torch.cat([self.tokens[a + c : b] for a, b, c in zip(cu, cu[1:], context_lens)]),
                       tuple(n - c for n, c in zip(self.prompt_lens, context_lens)))
