"""Old path of :mod:`cpattn.models.family` (``ModelFamily``, ``KVLayout``, ``get_family``, ...), re-exported.

The family declaration moved below the engine, to :mod:`cpattn.models.family`;
import it from there. (No DeprecationWarning yet: tests still import this path.)

>>> from cpattn.engine.family import ModelFamily
>>> ModelFamily.__module__
'cpattn.models.family'
"""

from cpattn.models.family import (CACHE_KINDS, FAMILY_MODULES, KVLayout, ModelFamily, get_family,  # noqa: F401
                                  nan_caches, param_dtype, register_backends)

__all__ = ["CACHE_KINDS", "FAMILY_MODULES", "KVLayout", "ModelFamily", "get_family", "nan_caches", "param_dtype",
           "register_backends"]
