"""The tests' independent references: float64 oracles written plainly, and the named cases op tests run.

Nothing here imports cpattn but :mod:`ref.greedy` (the library keeps its own float64 backends beside each fast path,
``cpattn.ops.ref`` and friends; these are written again, independently, for the tests). Modules:

- :mod:`ref.dense`: :func:`attention`, dense attention with an explicit (request, position) mask;
  :func:`req_pos`; :func:`plain_error`, the DESIGN.md §5 tolerance baseline;
- :mod:`ref.paged`: :func:`paged_attention` (a per-row loop over a paged cache), :func:`paged_cache`;
- :mod:`ref.sparse`: :func:`dsa`, DeepSeek sparse attention of a packed batch;
- :mod:`ref.topk`: :func:`topk_order` / :func:`topk_rows`, the shared top-k rule (score desc, index asc);
- :mod:`ref.v4`: DeepSeek-V4's gated pooling, window attention, whole-layer attention and CSA indexer;
- :mod:`ref.mlapo`: MLA decode preprocessing, the plain unfused chain;
- :mod:`ref.cases`: :class:`AttnCase`, :class:`PagedCase`;
- :mod:`ref.greedy`: :func:`recompute_greedy`, the whole-model token oracle (each token the argmax of a fresh
  one-device full prefill's last row) and :class:`OneDevice`, its memo (``conftest.py``'s ``one_device``
  fixture). The one module here that imports cpattn: it runs the families' own forward, never the engine.

Tests import it by name (``conftest.py`` puts ``tests/`` on ``sys.path``): ``import ref as oracle``,
``from ref.v4 import v4_attention_ref``.
"""

from .cases import AttnCase, PagedCase
from .dense import attention, plain_error, req_pos
from .paged import paged_attention, paged_cache
from .sparse import dsa
from .topk import topk_order, topk_rows

__all__ = ["AttnCase", "PagedCase", "attention", "plain_error", "req_pos", "paged_attention", "paged_cache", "dsa",
           "topk_order", "topk_rows"]
