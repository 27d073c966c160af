"""How every config reports what is wrong: one line per broken rule, all of them at once.

A problem reads ``"param: saw ...; rule: ...; fix: ..."``: the parameter to
change, the values seen, the rule and what to do. A config collects every
problem and raises one :class:`ConfigError` listing them.

Example
-------
>>> problem("tp_size", "0", "a positive int", "pass tp_size >= 1")
'tp_size: saw 0; rule: a positive int; fix: pass tp_size >= 1'
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message lists every broken rule, one per line.

    ``problems`` holds the lines (``"param: saw ...; rule: ...; fix: ..."``).
    """

    def __init__(self, kind: str, problems: list[str]):
        self.kind, self.problems = kind, list(problems)
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"invalid {kind} ({len(problems)} {noun}):\n  - " + "\n  - ".join(problems))


def problem(param: str, seen: str, rule: str, fix: str) -> str:
    """One broken rule as ``"param: saw ...; rule: ...; fix: ..."``."""
    return f"{param}: saw {seen}; rule: {rule}; fix: {fix}"


def raise_if(kind: str, problems: list[str]) -> None:
    """Raise :class:`ConfigError` when ``problems`` is not empty."""
    if problems:
        raise ConfigError(kind, problems)


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending (empty for n < 1).

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0] if n >= 1 else []


def positive_ints(obj: object, names: tuple[str, ...]) -> list[str]:
    """A problem for each field of ``obj`` in ``names`` that is not a positive int (None skipped)."""
    out = []
    for name in names:
        value = getattr(obj, name)
        if value is not None and (not is_int(value) or value < 1):
            out.append(problem(name, repr(value), "a positive int", f"pass an int >= 1 as {name}"))
    return out


def one_of(obj: object, choices: dict[str, tuple]) -> list[str]:
    """A problem for each field of ``obj`` whose value is not among its choices."""
    out = []
    for name, allowed in choices.items():
        value = getattr(obj, name)
        if value not in allowed:
            out.append(problem(name, repr(value), f"one of {list(allowed)}", f"pick {name} from {list(allowed)}"))
    return out


class Checked:
    """Base of every config dataclass: normalise, then raise one :class:`ConfigError` listing every problem.

    Subclasses define ``field_problems()`` (types and ranges of single
    fields), ``rule_problems()`` (rules between fields; run only when the
    fields are sound) and optionally ``_normalize()``.
    """

    def __post_init__(self) -> None:
        self._normalize()
        raise_if(type(self).__name__, self.problems())

    def _normalize(self) -> None:
        pass

    def field_problems(self) -> list[str]:
        return []

    def rule_problems(self) -> list[str]:
        return []

    def problems(self) -> list[str]:
        """Every broken rule as ``"param: saw ...; rule: ...; fix: ..."``; empty when valid."""
        return self.field_problems() or self.rule_problems()

    @classmethod
    def unchecked(cls, **values):
        """An instance built without validation (normalised), so :meth:`problems` can be asked of it."""
        import dataclasses

        obj = object.__new__(cls)
        for f in dataclasses.fields(cls):
            value = values[f.name] if f.name in values else f.default
            object.__setattr__(obj, f.name, value)
        obj._normalize()
        return obj


def normalize(obj: object, how: dict[str, object]) -> None:
    """Apply ``how[name]`` (e.g. ``str.lower``) to string fields of a frozen dataclass, in place."""
    for name, fn in how.items():
        value = getattr(obj, name)
        if isinstance(value, str):
            object.__setattr__(obj, name, fn(value))
