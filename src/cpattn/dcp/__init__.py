"""Decode context parallel: ``dcp_plan`` + ``dcp_decode`` over a DCP-sharded paged cache (DESIGN.md §4.3).

Each of the N ranks of the DCP group stores 1/N of every sequence (tokens
dealt in runs of ``interleave_size``, see :mod:`cpattn.layout.dcp`) and its
own TP slice of the query heads. A decode step::

    q [T, Hl, D] --all_gather(heads)--> [T, N*Hl, D]
       --paged_attention_with_lse(local shard)--> partial (O_r, L_r) for all N*Hl heads
       --merge--> [T, Hl, Dv], each rank its own heads again

Merges: ``"ag_rs"`` all-gathers the LSEs [T, N*Hl], rescales the local
output by ``exp(L_r - L)`` and reduce-scatters it over heads; ``"a2a"`` sends
``[O | L]`` of head slice j to rank j in one all-to-all and merges the N
partials there; ``"ag"`` all-gathers ``[O | L]`` and every rank merges every
head. All move O(T * H * D) per rank, independent of context length.

Fewer collectives: DCP reuses TP ranks, where the hidden state is the same on
every rank of the group, so a rank can compute the group's query heads
itself (``query="local"``) instead of gathering them: one collective per
layer with ``"a2a"`` (own heads) or ``"ag"`` (all heads). With TP's output
projection after it, :func:`dcp_fold_weights` folds the merge's rescale into
the TP all-reduce (a linear map commutes with the weighted sum), leaving one
all-gather of T x H LSEs as the only extra collective.

Plan / run split (for graph capture): :func:`dcp_plan` does the host work
(validation, the token count) once per batch and returns a :class:`DCPMeta`
of device tensors; :func:`plan_tensors` builds those tensors from
``seq_lens`` / ``query_lens`` / ``block_table`` with tensor ops only, so a
captured program can refresh them. :func:`dcp_decode` itself touches only
device tensors of static shape: no ``.item()``, no ``.tolist()``, no
data-dependent shapes (the CPU attention kernel does host work *inside* its
op, which a graph either calls as one opaque op or, for decode-sized batches
under torch.compile on CPU, replaces by the op's sync-free decomposition).

Above this package, programs name a DCP layer's wiring by one vocabulary,
:mod:`cpattn.dcp.layer_merges` (``"local_ag"``, ``"local_a2a"``, ``"a2a"``,
``"ag_rs"``, ``"local_fold"``), each a ``(query, merge)`` of
:func:`dcp_decode` (``MERGES`` / ``QUERIES`` here) plus the step that puts the
heads back together.
"""

# public names -> their module, imported on first use (PEP 562): ``cpattn.dcp.layer_merges`` (the merge
# vocabulary a command line checks) costs no import of torch
_EXPORTS = {
    "DCPContext": "cpattn.dcp.context",
    **dict.fromkeys(("MERGES", "QUERIES", "collectives_per_call", "dcp_attend_heads", "dcp_decode",
                     "dcp_fold_weights", "dcp_merge", "dcp_partials"), "cpattn.dcp.decode"),
    **dict.fromkeys(("LAYER_MERGES", "ENGINE_MERGES", "ENGINE_MERGE", "PROGRAM_MERGES", "layer_merge"),
                    "cpattn.dcp.layer_merges"),
    **dict.fromkeys(("DCPMeta", "dcp_plan", "plan_tensors"), "cpattn.dcp.plan"),
}
__all__ = list(_EXPORTS)

from cpattn._lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
