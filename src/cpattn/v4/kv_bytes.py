"""Old path of :mod:`cpattn.bench.v4_kv_bytes` (exact KV bytes per token, V4 vs V3.2 vs dense MLA: a
benchmark helper, not a V4 primitive), re-exported: import it from there.

(No DeprecationWarning yet: tests and notebooks/deepseek_v4.ipynb still import this path.)
"""

from cpattn.bench.v4_kv_bytes import (V3, V4, V32, MLASizes, V4Sizes, kv_bytes_table,  # noqa: F401
                                      mla_kv_elements, v4_kv_elements)

__all__ = ["V3", "V4", "V32", "MLASizes", "V4Sizes", "kv_bytes_table", "mla_kv_elements", "v4_kv_elements"]
