"""The step loop's drafts: one drafter state for the engine, a cache slot per running request.

After each step, every request that sampled gets ``k`` drafts for its next
step from its whole history (prompt + outputs, the bonus token last); the
scheduler caps them by the budget and by ``max_tokens``, the runner verifies
them (:func:`cpattn.engine.decode.accept_drafts`), and what was rejected is
rolled back here before the next proposal. A request keeps its slot while it
runs; a finished, aborted or preempted one gives it back (its rows are
forgotten: the next holder's history is fed from the start). A drafter
that reads the target's hidden states (MTP, Eagle3, DSpark: ``hidden_layers``)
gets, with each proposal, the hidden rows of the positions the target made
final since its last proposal (every prefill chunk's rows, then each
decode's last token and accepted drafts), as a
:class:`~cpattn.engine.drafters.TargetHidden`.

Example
-------
>>> from cpattn.drafters.ngram import NgramDrafter
>>> p = Proposer(NgramDrafter(), 2, max_num_seqs=2, max_len=16)
>>> p.propose({"a": [1, 2, 3, 1, 2]}), p.slots
({'a': [3, 1]}, {'a': 0})
>>> p.release(["a"]); p.slots
{}
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from cpattn.engine.drafters import TargetHidden


class Proposer:
    """``k`` drafts per request from ``drafter`` (module docstring); ``max_len``: tokens a slot holds."""

    def __init__(self, drafter, k: int, *, max_num_seqs: int, max_len: int, graph: str | None = None) -> None:
        self.hidden_layers = getattr(drafter, "hidden_layers", None)
        self.k, self.state = k, drafter.start(max_num_seqs, max_len, graph=graph)
        self.slots: dict[Hashable, int] = {}
        self._free = list(range(max_num_seqs))

    def propose(self, histories: dict[Hashable, list[int]], hidden: dict | None = None) -> dict[Hashable, list[int]]:
        """Drafts for each request from its history (everything it holds, the last token not yet cached);
        ``hidden[req_id] = (start, {name: [n, F]})``: the target's final hidden rows of positions
        ``start .. start + n - 1`` not given to the drafter before (drafters with ``hidden_layers``)."""
        for rid in histories:
            if rid not in self.slots:
                self.slots[rid] = self._free.pop(0)
        order = sorted(histories, key=self.slots.__getitem__)
        slots = [self.slots[r] for r in order]
        self.state.rollback(slots, [len(histories[r]) - 1 for r in order])  # the target keeps what it verified
        target = None
        if self.hidden_layers is not None:
            target = _target_hidden([hidden[r] for r in order], 1 + self.k)  # a verify step's rows: uniform
        drafts = self.state.propose([histories[r] for r in order], self.k, slots, target)
        return {r: drafts[i].tolist() for i, r in enumerate(order)}

    def release(self, req_ids: Iterable[Hashable]) -> None:
        """Give the slots of these requests back (unknown ids: no-op)."""
        for rid in req_ids:
            slot = self.slots.pop(rid, None)
            if slot is not None:
                self.state.rollback([slot], [0])
                self._free.append(slot)
                self._free.sort()


def _target_hidden(parts: list[tuple[int, dict]], min_rows: int = 1) -> TargetHidden:
    """[(start, {name: [n_i, F]})] -> a :class:`TargetHidden` with rows [A, Q, F] (zero-padded), Q = max(n_i,
    ``min_rows``): the proposer passes 1 + k, so after a decode step the catch-up always has the verify step's
    1 + k rows per request (``valid`` = 1 + accepted) and a captured draft step replays even when every
    request rejected drafts (:mod:`cpattn.drafters.chain`)."""
    q = max(min_rows, *(next(iter(h.values())).shape[0] for _, h in parts))
    rows = {}
    for name in parts[0][1]:
        first = parts[0][1][name]
        out = first.new_zeros(len(parts), q, first.reshape(first.shape[0], -1).shape[-1])  # [A, Q, F]
        for i, (_, h) in enumerate(parts):
            x = h[name].reshape(h[name].shape[0], -1)
            out[i, :x.shape[0]] = x
        rows[name] = out
    return TargetHidden(rows, tuple(s for s, _ in parts),
                        tuple(next(iter(h.values())).shape[0] for _, h in parts))
