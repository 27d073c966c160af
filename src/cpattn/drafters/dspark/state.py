"""The per-rank DSpark draft state: context rows held per request, one captured block step per call."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from cpattn.drafters.dspark.config import check_features
from cpattn.drafters.dspark.step import dspark_step, step_fields
from cpattn.engine.drafters import TargetHidden
from cpattn.graphs.runner import DecodeRunner

if TYPE_CHECKING:
    from cpattn.drafters.dspark.drafter import DSparkDrafter


class DSparkState:
    """Per-rank DSpark state: context rows held per request, one block step per call (see module doc).

    calibration: one ``(confidence [k], accepted)`` pair per request and
    verification step -- the survival estimates of the k verified drafts
    and how many of them the target accepted.
    """

    def __init__(self, drafter: DSparkDrafter, num_requests: int, max_len: int, graph: str | None):
        c = drafter.cfg
        self.cfg, self.params, self.graph = c, drafter.params, graph
        self.num_requests, self.max_len = num_requests, max_len + c.block_size  # the block may run past max_len
        self.dtype = self.params["fc.weight"].dtype
        cache = torch.zeros(c.num_hidden_layers, 2, num_requests + 1, self.max_len + 1, c.num_key_value_heads,
                            c.head_dim, dtype=self.dtype)
        self.state = {"params": self.params, "cache": cache}
        self.lo, self.held, self.started = [0] * num_requests, [0] * num_requests, [False] * num_requests
        self.pending: dict[int, tuple[list[float], int]] = {}  # request -> (confidences, anchor position)
        self.calibration: list[tuple[list[float], int]] = []
        self.runners: dict[int, DecodeRunner] = {}

    def runner(self, q_len: int) -> DecodeRunner:
        """The step's runner for ``q_len`` context rows per request (captured on first use with a graph;
        another number of rows runs eagerly)."""
        if q_len not in self.runners:
            k = q_len - 1
            r = DecodeRunner(functools.partial(dspark_step, cfg=self.cfg), self.state,
                             step_fields(self.num_requests, self.max_len, self.cfg.feature_size, self.dtype),
                             num_speculative_tokens=k, capture_sizes=[self.num_requests * q_len],
                             backend=self.graph or "eager")
            self.runners[q_len] = r.capture() if self.graph is not None else r
        return self.runners[q_len]

    def propose(self, histories: list[list[int]], k: int, requests: list[int],
                hidden: TargetHidden | None = None) -> torch.Tensor:
        """The first k drafts of one block per request: [A, k] int64."""
        if k > self.cfg.block_size:
            raise ValueError(f"num_speculative_tokens={k} > the DSpark block size {self.cfg.block_size}; verify at "
                             f"most block_size drafts (or train a head with a larger block)")
        if hidden is None:
            raise ValueError("DSpark reads the target's hidden states: propose(..., hidden=TargetHidden)")
        feats = torch.cat([hidden.rows[i] for i in self.cfg.target_layer_ids], -1)  # [A, Q, F]
        check_features(self.cfg, feats.shape[-1])
        a, q = feats.shape[:2]
        req, pos = [], []
        for i, (r, h) in enumerate(zip(requests, histories)):
            start, valid = hidden.start[i], hidden.valid[i]
            if not self.started[r]:
                self.lo[r] = self.held[r] = start
                self.started[r] = True
            if start != self.held[r] or start + valid != len(h) - 1:
                raise ValueError(f"request {r}: hidden rows at positions {start}..{start + valid - 1} do not continue "
                                 f"the held context (up to {self.held[r]}) to position {len(h) - 2}")
            req += [r] * q
            pos += [start + j if j < valid else self.max_len for j in range(q)]
            self.held[r] = start + valid
        batch = {"features": feats.reshape(a * q, -1).to(self.dtype), "req": torch.tensor(req),
                 "pos": torch.tensor(pos), "anchor": torch.tensor([h[-1] for h in histories]),
                 "start": torch.tensor([len(h) - 1 for h in histories]), "row": torch.tensor(requests),
                 "lo": torch.tensor([self.lo[r] for r in requests])}
        drafts, conf = self.runner(1 + k)(batch, [q] * a)  # the prompt's rows (q != 1 + k): eager
        for i, r in enumerate(requests):
            self.pending[r] = (conf[i, :k].tolist(), len(histories[i]) - 1)
        return drafts[:, :k]

    def rollback(self, requests: list[int], keep_lens: list[int]) -> None:
        """Record each verified block's survival (for calibration); block rows lie past the held context."""
        for r, n in zip(requests, keep_lens):
            if r in self.pending:
                conf, anchor = self.pending.pop(r)
                self.calibration.append((conf, int(n) - anchor - 1))
            self.held[r] = min(self.held[r], max(int(n), self.lo[r]))
            if not n:  # the slot freed (the engine's release): its next request starts afresh
                self.started[r] = False

