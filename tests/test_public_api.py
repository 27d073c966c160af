"""The public surface is pinned: a removed or renamed public name is a decision, not an accident.

tests/data/public_api.json lists ``__all__`` of ``cpattn`` and of every subpackage that declares one.
A name that disappears fails here: keep it as a deprecated alias (a DeprecationWarning naming the new
one) for a release and record it in CHANGELOG.md. A new name fails too until it is added to the file
(``python tests/test_public_api.py`` rewrites it), so every addition is seen in review.
"""

import importlib
import json
import pathlib
import pkgutil

PINNED = pathlib.Path(__file__).parent / "data" / "public_api.json"


def surface() -> dict[str, list[str]]:
    import cpattn

    mods = ["cpattn"] + sorted(m.name for m in pkgutil.iter_modules(cpattn.__path__, "cpattn.") if m.ispkg)
    out = {}
    for name in mods:
        names = getattr(importlib.import_module(name), "__all__", None)
        if names is not None:
            out[name] = sorted(names)
    return out


def test_no_public_name_disappears_and_every_new_one_is_recorded():
    pinned, now = json.loads(PINNED.read_text()), surface()
    gone = {m: sorted(set(names) - set(now.get(m, []))) for m, names in pinned.items()}
    gone = {m: n for m, n in gone.items() if n}
    assert not gone, f"public names removed (keep a deprecated alias and say so in CHANGELOG.md): {gone}"
    new = {m: sorted(set(names) - set(pinned.get(m, []))) for m, names in now.items()}
    new = {m: n for m, n in new.items() if n}
    assert not new, f"new public names: add them to {PINNED.name} (python tests/test_public_api.py): {new}"


def test_every_pinned_name_resolves():
    for module, names in surface().items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, f"{module}.__all__ names {missing}, which it does not define"


if __name__ == "__main__":
    PINNED.write_text(json.dumps(surface(), indent=1, sort_keys=True) + "\n")
