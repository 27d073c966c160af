"""Old path of :mod:`cpattn.engine.classic` (the classic entry points: ``generate``, ``speculative_generate``,
``disagg_generate``, ``pcp_dcp_generate`` and their ``*_on_rank`` forms), re-exported: import them from there.

They call the engine, so they moved above it; this module is the one place :mod:`cpattn.models` still
imports :mod:`cpattn.engine`, for compatibility. (No DeprecationWarning yet: tests, docs and notebooks still
import this path.)
"""

from cpattn.engine.classic import (  # noqa: F401
    generate, generate_on_rank, speculative_generate, speculative_generate_on_rank, pd_configs,
    disagg_generate, pd_generate_on_rank, pcp_dcp_config, pcp_dcp_generate_on_rank, pcp_dcp_generate,
)

__all__ = ["generate", "generate_on_rank", "speculative_generate", "speculative_generate_on_rank",
           "pd_configs", "disagg_generate", "pd_generate_on_rank", "pcp_dcp_config",
           "pcp_dcp_generate_on_rank", "pcp_dcp_generate"]
