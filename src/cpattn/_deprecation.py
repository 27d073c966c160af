"""Keyword arguments renamed under the one-vocabulary rule: the old keyword still works for a release,
with a DeprecationWarning naming the new one (torch-free; any layer may use it).

>>> import warnings
>>> @renamed_kwargs(prefill_size="pcp_size")
... def f(*, pcp_size):
...     return pcp_size
>>> with warnings.catch_warnings(record=True) as w:
...     warnings.simplefilter("always")
...     f(prefill_size=2), str(w[0].message)
(2, 'f(prefill_size=) is deprecated; pass pcp_size=')
"""

from __future__ import annotations

import functools
import warnings


def renamed_kwargs(**old_to_new: str):
    """Decorator: each keyword ``old`` given to the function is passed on as ``new`` (a DeprecationWarning
    names ``new``); both at once is a TypeError. The wrapped signature is the new one (``inspect`` follows
    ``__wrapped__``)."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got {old}= and {new}=; pass {new}= only "
                                        f"({old} is its deprecated name)")
                    warnings.warn(f"{fn.__name__}({old}=) is deprecated; pass {new}=", DeprecationWarning,
                                  stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return inner

    return wrap
