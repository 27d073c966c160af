"""``Algorithms``: how the engine carries out each parallel step (results are the same either way).

- ``pcp_method``: "ring" (KV passed around the PCP group, overlapped with
  compute) or "allgather" (KV gathered once) -- :func:`cpattn.pcp_prefill`;
- ``dsa_split``: how a DSA model's prefill tokens are split over the group:
  "balanced" (the PCP head-tail chunks) or "contiguous" (the guide's DSA-CP);
- ``dcp_merge``: "ag_rs" (all-gather LSE + reduce-scatter) or "a2a" (one
  all-to-all) -- :func:`cpattn.dcp.dcp_decode`;
- ``handoff``: how prefill KV reaches the DCP owners when both engines share
  ranks: "a2a" (each row sent to its owner, one all-to-all) or "allgather"
  (everything gathered, each rank keeps its own).

Example
-------
>>> Algorithms(pcp_method="allgather").dcp_merge
'ag_rs'
"""

from __future__ import annotations

from dataclasses import dataclass

CHOICES = {"pcp_method": ("ring", "allgather"), "dsa_split": ("balanced", "contiguous"),
           "dcp_merge": ("ag_rs", "a2a"), "handoff": ("a2a", "allgather")}


@dataclass(frozen=True)
class Algorithms:
    """pcp_method, dsa_split, dcp_merge, handoff (see module doc)."""

    pcp_method: str = "ring"
    dsa_split: str = "balanced"
    dcp_merge: str = "ag_rs"
    handoff: str = "a2a"

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}; got {getattr(self, name)!r}")
