"""Linear-attention layers under context parallelism (Gated DeltaNet: Qwen3-Next, Qwen3.5).

- :mod:`cpattn.linear.layout`: sequence-order segments per rank (contiguous, or head-tail as the attention layers).
- :mod:`cpattn.linear.scan`: exact PCP by a scan of chunk summaries (one all-gather) and conv halos.
- :mod:`cpattn.linear.state`: per-request recurrent and conv states on one device, the models' linear step.
- :mod:`cpattn.linear.pcp_step`: the same step over a PCP group (the linear layers of a PCP prefill).

The ops themselves are :mod:`cpattn.ops.gated_delta`; docs/hybrid.md explains how it fits together.
"""

from cpattn.linear.layout import ScanLayout, scan_shard, segment_bounds
from cpattn.linear.scan import pcp_causal_conv1d, pcp_gated_delta

__all__ = ["ScanLayout", "scan_shard", "segment_bounds", "pcp_causal_conv1d", "pcp_gated_delta"]
