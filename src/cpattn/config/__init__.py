"""Configuration, split as vLLM splits it: one engine = a model and five configs.

- :class:`ModelConfig`: attention kind and head counts (what the rules need).
- :class:`ParallelConfig`: tp / pcp / dcp sizes, DSA-CP, the PCP+DCP opt-in.
- :class:`CacheConfig`: block size and the DCP interleave size.
- :class:`KVTransferConfig`: P/D roles, KV pooling.
- :class:`SpeculativeConfig`: speculative method and draft tokens.
- :class:`CompilationConfig`: graph mode, capture sizes, graph backend.
- :class:`SchedulerConfig`: the step loop's token budget, request cap, chunked prefill, prefix caching.
- :class:`EngineConfig`: all of them, checked against every rule of the
  CP guide (DESIGN.md §8) that spans parts.

A rule that protects correctness refuses; a rule of the guide that only
says what vLLM-Ascend's engine supports is a compatibility note
(:meth:`EngineConfig.compat_notes`, a :class:`GuideCompatWarning`), refused
with ``strict_guide=True`` (docs/compat.md classifies every rule).

Every config reports every broken rule at once, each as
``"param: saw ...; rule: ...; fix: ..."`` in one :class:`ConfigError`
(a ``ValueError``).

Example
-------
>>> from cpattn.config import EngineConfig
>>> cfg = EngineConfig.create(tp_size=8, dcp_size=2, attention="gqa", num_kv_heads=4)
>>> cfg.parallel.dcp_size, cfg.cache.block_size
(2, 128)
"""

from cpattn.config.cache import CacheConfig
from cpattn.config.compilation import GRAPH_MODES, CompilationConfig
from cpattn.config.engine import PCP_SPEC_METHODS, EngineConfig, GuideCompatWarning
from cpattn.config.kv_transfer import KV_ROLES, KV_TRANSFERS, KVTransferConfig
from cpattn.config.model import ATTENTION_KINDS, ModelConfig
from cpattn.config.parallel import ParallelConfig
from cpattn.config.problems import ConfigError
from cpattn.config.scheduler import SchedulerConfig
from cpattn.config.speculative import SpeculativeConfig

__all__ = [
    "EngineConfig", "ModelConfig", "ParallelConfig", "CacheConfig", "KVTransferConfig", "SpeculativeConfig",
    "CompilationConfig", "SchedulerConfig", "ConfigError", "ATTENTION_KINDS", "GRAPH_MODES", "KV_ROLES", "KV_TRANSFERS",
    "PCP_SPEC_METHODS", "GuideCompatWarning",
]
