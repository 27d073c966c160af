"""Every drafter by name (:data:`DRAFTERS`), each module imported on first use.

A drafter is built as ``DRAFTERS[name](**its arguments)`` or ``DRAFTERS[name].from_checkpoint(dir)``;
the names are ``SpeculativeConfig.speculative_method``'s. The protocol they follow is
:mod:`cpattn.engine.drafters`'s; the registry lives here, beside the drafters, so the engine never
names them.

Example
-------
>>> from cpattn.drafters.registry import DRAFTERS
>>> sorted(DRAFTERS)
['draft_model', 'dspark', 'eagle3', 'mtp', 'ngram']
>>> DRAFTERS["ngram"]().start(num_requests=1, max_len=16).propose([[5, 6, 5]], 2, [0]).shape
torch.Size([1, 2])
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping


class Registry(Mapping):
    """Drafter name -> class, importing a method's module on first use (its weights code is not free).

    >>> from cpattn.drafters.ngram import NgramDrafter
    >>> DRAFTERS["ngram"] is NgramDrafter, "mtp" in DRAFTERS
    (True, True)
    """

    def __init__(self, entries: dict[str, type | str]):
        self._entries = dict(entries)

    def __getitem__(self, name: str) -> type:
        if name not in self._entries:
            raise KeyError(f"unknown drafter {name!r}; known: {sorted(self._entries)}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module, cls = entry.split(":")
            entry = self._entries[name] = getattr(importlib.import_module(module), cls)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


DRAFTERS = Registry({
    "ngram": "cpattn.drafters.ngram:NgramDrafter",
    "draft_model": "cpattn.drafters.draft_model:ModelDrafter",
    "mtp": "cpattn.drafters.mtp:MTPDrafter",
    "eagle3": "cpattn.drafters.eagle3:Eagle3Drafter",
    "dspark": "cpattn.drafters.dspark:DSparkDrafter",
})
