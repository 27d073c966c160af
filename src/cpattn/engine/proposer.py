"""The step loop's drafts: one drafter state for the engine, a cache slot per running request.

After each step, every request that sampled gets ``k`` drafts for its next
step from its whole history (prompt + outputs, the bonus token last); the
scheduler caps them by the budget and by ``max_tokens``, the runner verifies
them (:func:`cpattn.engine.decode.accept_drafts`), and what was rejected is
rolled back here before the next proposal. A request keeps its slot while it
runs; a finished, aborted or preempted one gives it back (its rows are
forgotten: the next holder's history is fed from the start). Drafters that
read the target's hidden states are not served by the step loop yet.

Example
-------
>>> from cpattn.engine.drafters import NgramDrafter
>>> p = Proposer(NgramDrafter(), 2, max_num_seqs=2, max_len=16)
>>> p.propose({"a": [1, 2, 3, 1, 2]}), p.slots
({'a': [3, 1]}, {'a': 0})
>>> p.release(["a"]); p.slots
{}
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class Proposer:
    """``k`` drafts per request from ``drafter`` (module docstring); ``max_len``: tokens a slot holds."""

    def __init__(self, drafter, k: int, *, max_num_seqs: int, max_len: int, graph: str | None = None) -> None:
        if getattr(drafter, "hidden_layers", None) is not None:
            raise ValueError(f"the {drafter.method} drafter reads the target's hidden states; the step loop "
                             "serves token-only drafters (ngram, draft_model) so far: use cpattn.engine.generate")
        self.k, self.state = k, drafter.start(max_num_seqs, max_len, graph=graph)
        self.slots: dict[Hashable, int] = {}
        self._free = list(range(max_num_seqs))

    def propose(self, histories: dict[Hashable, list[int]]) -> dict[Hashable, list[int]]:
        """Drafts for each request from its history (everything it holds, the last token not yet cached)."""
        for rid in histories:
            if rid not in self.slots:
                self.slots[rid] = self._free.pop(0)
        order = sorted(histories, key=self.slots.__getitem__)
        slots = [self.slots[r] for r in order]
        self.state.rollback(slots, [len(histories[r]) - 1 for r in order])  # the target keeps what it verified
        drafts = self.state.propose([histories[r] for r in order], self.k, slots, None)
        return {r: drafts[i].tolist() for i, r in enumerate(order)}

    def release(self, req_ids: Iterable[Hashable]) -> None:
        """Give the slots of these requests back (unknown ids: no-op)."""
        for rid in req_ids:
            slot = self.slots.pop(rid, None)
            if slot is not None:
                self.state.rollback([slot], [0])
                self._free.append(slot)
                self._free.sort()
