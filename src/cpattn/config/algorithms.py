"""``Algorithms``: how the engine carries out each parallel step (results are the same either way).

- ``pcp_method``: "ring" (KV passed around the PCP group, overlapped with
  compute) or "allgather" (KV gathered once) -- :func:`cpattn.pcp_prefill`;
- ``dsa_split``: how a DSA model's prefill tokens are split over the group:
  "balanced" (the PCP head-tail chunks) or "contiguous" (the guide's DSA-CP);
- ``dcp_merge``: how a DCP decode layer gets every head's exact output on
  every rank (:class:`cpattn.engine.paged_cache.DCPStep`); one of the
  engine's names of the merge vocabulary, :mod:`cpattn.dcp.layer_merges`
  (its table gives each name's wiring); collectives per layer in brackets:
  "local_ag" (default; the hidden state is replicated, so every rank
  computes all query heads, then one all-gather of ``[O | L]``) [1],
  "local_a2a" (local heads, one all-to-all, output heads gathered) [2],
  "a2a" (query heads gathered, all-to-all, output gathered) [3], "ag_rs"
  (query gathered, LSE all-gather + reduce-scatter, output gathered) [4];
- ``handoff``: how prefill KV reaches the DCP owners when both engines share
  ranks: "a2a" (each row sent to its owner, one all-to-all) or "allgather"
  (everything gathered, each rank keeps its own).

Example
-------
>>> Algorithms(pcp_method="allgather").dcp_merge
'local_ag'
"""

from __future__ import annotations

from dataclasses import dataclass

from cpattn.dcp.layer_merges import ENGINE_MERGE, ENGINE_MERGES, layer_merge

CHOICES = {"pcp_method": ("ring", "allgather"), "dsa_split": ("balanced", "contiguous"),
           "dcp_merge": ENGINE_MERGES, "handoff": ("a2a", "allgather")}


@dataclass(frozen=True)
class Algorithms:
    """pcp_method, dsa_split, dcp_merge, handoff (see module doc)."""

    pcp_method: str = "ring"
    dsa_split: str = "balanced"
    dcp_merge: str = ENGINE_MERGE
    handoff: str = "a2a"

    def __post_init__(self):
        layer_merge(self.dcp_merge, ENGINE_MERGES, what="dcp_merge")  # names the engine's four, and why not local_fold
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}; got {getattr(self, name)!r}")
