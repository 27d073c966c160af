"""Deprecated old path of :mod:`cpattn.bench.pool_blocks` (the pool's per-block micro-benchmark moved beside
the other benchmarks).

Importing this module warns (DeprecationWarning) and re-exports the new module's names;
import :mod:`cpattn.bench.pool_blocks` instead. Kept for one release.
"""

from cpattn.drafters._moved import alias

alias(__name__, "cpattn.bench.pool_blocks", globals())
