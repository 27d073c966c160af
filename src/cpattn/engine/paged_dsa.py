"""Deprecated old path of :mod:`cpattn.dsa.paged` (the static-shape exact top-k over a key-sharded paged cache).

Importing this module warns (DeprecationWarning) and re-exports every name;
import :mod:`cpattn.dsa.paged` instead.
"""

import warnings

from cpattn.dsa.paged import (dsa_topk, global_ids, local_slots, owned_slots, sharded_topk,  # noqa: F401
                              sparse_partials_merged)

warnings.warn("cpattn.engine.paged_dsa moved to cpattn.dsa.paged; import it from there", DeprecationWarning,
              stacklevel=2)

__all__ = ["dsa_topk", "global_ids", "local_slots", "owned_slots", "sharded_topk", "sparse_partials_merged"]
