"""The draft state of autoregressive drafters on target hidden states (MTP, Eagle3): catch up, then chain.

Both methods keep one draft row per position p, built from a feature of
position p and the token after it, ``row(p) = f(feature_p, t_{p + 1})``,
which predicts ``t_{p + 2}``. Rows whose feature is the target's hidden
state and whose token is final are *held* (positions ``lo .. held - 1``);
rows built on drafts are provisional. Per call of :meth:`ChainState.propose`
(history ``t_0 .. t_{L-1}``, ``held = L - 1 - valid``)::

    catch-up   rows held .. held + Q - 1 from the target's hidden rows; the first `valid`
               (up to position L - 2, token t_{L-1}) become held; draft 1 from row L - 2
    chain d    row L - 2 + d = f(own feature of row L - 3 + d, draft d) -> draft d + 1,
               for d = 1 .. k - 1 (provisional: overwritten by the next catch-up)

After a verification step the catch-up has ``Q = 1 + k`` rows per request
(the verified rows; ``valid = 1 + accepted``), so it is uniform, as is
every chain step (one row per request): both are
:class:`~cpattn.graphs.DecodeRunner` programs (FULL_DECODE_ONLY), each
captured at one size -- every request's rows (the catch-up's a multiple
of 1 + k); fewer active requests pad up to it. Rows past ``valid`` write the
scratch slot and see no key. The prompt's catch-up (any length) runs
eagerly through the same function.

A method supplies ``features(hidden_rows) -> [..., F]`` (target hidden
states -> row features), a capturable ``step(state, batch) -> (tokens [T],
features [T, F])`` over the batch of :func:`step_fields`, its cache shape,
and the per-rank state's tensors ``{"params": ..., "cache": ...}``.
"""

from __future__ import annotations

from typing import Callable

import torch

from cpattn.engine.drafters import TargetHidden
from cpattn.graphs.runner import DecodeRunner, Field


def step_fields(num_requests: int, max_len: int, feature_dim: int, dtype: torch.dtype) -> dict[str, Field]:
    """The per-row inputs of a chain step (every one a token row; padding rows are inert).

    tokens: the token after the row's position; features: [F] the row's
    feature; req / pos: where the row's KV goes (pad: the scratch request
    ``num_requests`` and position ``max_len``); lo / hi: its visible key
    range (pad 0, 0: no key).

    >>> sorted(step_fields(2, 8, 4, torch.float32))
    ['features', 'hi', 'lo', 'pos', 'req', 'tokens']
    """
    return {"tokens": Field("token", (), torch.int64, pad=0),
            "features": Field("token", (feature_dim,), dtype, pad=0),
            "req": Field("token", (), torch.int64, pad=num_requests),
            "pos": Field("token", (), torch.int64, pad=max_len),
            "lo": Field("token", (), torch.int64, pad=0),
            "hi": Field("token", (), torch.int64, pad=0)}


class ChainState:
    """Per-rank draft state of a catch-up-and-chain drafter (see module doc).

    step: ``step(state, batch) -> (tokens [T] target ids, features [T, F])``;
    features: target hidden rows ``{name: [..., H]}`` -> ``[..., F]``;
    state: ``{"params": ..., "cache": ...}`` (the cache written in place);
    graph: a graph backend name for the two step programs, or None (eager).

    >>> from cpattn.drafters.eagle3 import Eagle3Drafter
    >>> from cpattn.models import qwen3
    >>> cfg = qwen3.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    >>> state = Eagle3Drafter.random(qwen3.init_params(cfg), cfg).start(num_requests=1, max_len=16)
    >>> rows = TargetHidden({i: torch.randn(1, 3, 16) for i in (0, 1, 2)}, (0,), (3,))  # the prompt's rows
    >>> state.propose([[4, 5, 6, 7]], 3, [0], rows).shape, state.held
    (torch.Size([1, 3]), [3])
    """

    def __init__(self, step: Callable, features: Callable, state: dict, *, num_requests: int, max_len: int,
                 feature_dim: int, dtype: torch.dtype, graph: str | None = None):
        self.step, self.features, self.state = step, features, state
        self.num_requests, self.max_len, self.feature_dim, self.dtype = num_requests, max_len, feature_dim, dtype
        self.graph = graph
        self.lo = [0] * num_requests  # first position with a row (a cached prefix has none)
        self.held = [0] * num_requests  # positions < held have final rows
        self.started = [False] * num_requests
        self.runners: dict[int, DecodeRunner] = {}  # rows per request -> runner

    def runner(self, q_len: int) -> DecodeRunner:
        """The step's runner for ``q_len`` rows per request (captured on first use when ``graph`` is set)."""
        if q_len not in self.runners:
            k = q_len - 1
            sizes = [self.num_requests * q_len]  # one program: fewer requests are padded up to it
            r = DecodeRunner(self.step, self.state, step_fields(self.num_requests, self.max_len, self.feature_dim,
                                                                self.dtype),
                             num_speculative_tokens=k, capture_sizes=sizes, backend=self.graph or "eager")
            self.runners[q_len] = r.capture() if self.graph is not None else r
        return self.runners[q_len]

    def run(self, batch: dict, q_lens: list[int], rows: int):
        """One step over rows grouped by request (``q_lens`` rows each) through the runner for ``rows`` rows
        per request -- 1 + k for a catch-up, 1 for a chain step; another length (the prompt's catch-up)
        runs eagerly. Returns (tokens [T], features [T, F])."""
        return self.runner(rows)(batch, q_lens)

    def propose(self, histories: list[list[int]], k: int, requests: list[int],
                hidden: TargetHidden | None = None) -> torch.Tensor:
        """k greedy drafts per request: [A, k] int64 (target token ids)."""
        if hidden is None:
            raise ValueError("this drafter reads the target's hidden states: propose(..., hidden=TargetHidden) "
                             "with the rows computed since the previous call (the engine passes them)")
        a = len(requests)
        feats = self.features(hidden.rows)  # [A, Q, F]
        q = feats.shape[1]
        tokens, req, pos, lo, hi, last = [], [], [], [], [], []
        for i, (r, h) in enumerate(zip(requests, histories)):
            start, valid = hidden.start[i], hidden.valid[i]
            if not self.started[r]:
                self.lo[r] = self.held[r] = start
                self.started[r] = True
            if start != self.held[r] or start + valid != len(h) - 1 or valid < 1:
                raise ValueError(
                    f"request {r}: hidden rows at positions {start}..{start + valid - 1} do not continue the draft's "
                    f"rows (held up to {self.held[r]}) to the history's last known position {len(h) - 2}")
            for j in range(q):
                ok = j < valid
                tokens.append(h[start + j + 1] if ok else 0)
                req.append(r)
                pos.append(start + j if ok else self.max_len)
                lo.append(self.lo[r])
                hi.append(start + j + 1 if ok else 0)
            last.append(i * q + valid - 1)
            self.held[r] = start + valid
        batch = {"tokens": torch.tensor(tokens), "features": feats.reshape(a * q, -1).to(self.dtype),
                 "req": torch.tensor(req), "pos": torch.tensor(pos), "lo": torch.tensor(lo), "hi": torch.tensor(hi)}
        tok, feat = self.run(batch, [q] * a, 1 + k)
        idx = torch.tensor(last)
        tok, feat = tok[idx], feat[idx]  # [A], [A, F]
        drafts = [tok]
        reqs = torch.tensor(requests)
        los = torch.tensor([self.lo[r] for r in requests])
        for d in range(1, k):
            p = torch.tensor([self.held[r] - 1 + d for r in requests])  # provisional rows past the held ones
            tok, feat = self.run({"tokens": tok, "features": feat, "req": reqs, "pos": p, "lo": los, "hi": p + 1},
                                 [1] * a, 1)
            drafts.append(tok)
        return torch.stack(drafts, 1)  # [A, k]

    def rollback(self, requests: list[int], keep_lens: list[int]) -> None:
        """Keep rows of final tokens only: provisional rows are never read again (they lie past ``held``).
        ``keep_lens[i] = 0`` frees the slot (the engine's release): its next request starts afresh, from the
        first position it brings rows of (after a prefix hit, not 0)."""
        for r, n in zip(requests, keep_lens):
            self.held[r] = min(self.held[r], max(int(n), self.lo[r]))
            if not n:
                self.started[r] = False
