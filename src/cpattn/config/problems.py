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


def searched_fix(line: str, flat: dict, fix_fields: dict, ok, *, shown: int = 3, also: tuple = (),
                 progress=None) -> str:
    """``line`` (a problem) with its ``fix:`` replaced by values that pass every rule.

    ``fix_fields[param]`` names the integer fields that may change for a
    problem of ``param``; each is searched nearest first (1 .. max(32, 2 x
    the value seen)) with ``ok({field: value})`` (True: no problem left), and
    the fix offers the first ``shown`` (``shown - 1`` for the alternatives).
    When no single field passes (another rule is broken too), pairs of
    this problem's first field and a field of ``also`` (the other problems'
    fields) are searched, nearest first: ``set a=1 and b=2``; failing that,
    single values for which ``progress({field: value})`` holds (this rule
    fixed, nothing new broken: the other problems' own fixes do the rest).
    No such value either: the fix says so (no unchecked number is offered).
    A problem with nothing to search keeps its fix.

    >>> line = problem("dcp_size", "3", "divides 4", "use dcp_size in [1, 2, 4]")
    >>> searched_fix(line, {"dcp_size": 3}, {"dcp_size": ("dcp_size",)}, lambda c: 4 % c["dcp_size"] == 0)
    'dcp_size: saw 3; rule: divides 4; fix: use dcp_size in [2, 4, 1]'
    """
    param = line.split(":", 1)[0]
    head, sep, old = line.rpartition("; fix: ")
    if not sep or param not in fix_fields:
        return line
    offers = []
    for i, name in enumerate(fix_fields[param]):
        cur = flat.get(name)
        if not is_int(cur) or cur < 1:
            continue
        values = sorted(range(1, max(32, 2 * cur) + 1), key=lambda v: (abs(v - cur), v))
        found = []
        for v in values:
            if v != cur and ok({name: v}):
                found.append(v)
                if len(found) == (shown if i == 0 else shown - 1):
                    break
        if found:
            what = f"{name}={found[0]}" if len(found) == 1 else f"{name} in {found}"
            offers.append(what if offers else ("set " if len(found) == 1 else "use ") + what)
    if not offers and also:
        first = next((n for n in fix_fields[param] if is_int(flat.get(n)) and flat[n] >= 1), None)
        for other in (n for n in dict.fromkeys(also) if n != first and is_int(flat.get(n)) and flat[n] >= 1):
            if first is None:
                break
            pairs = sorted(((a, b) for a in _near(flat[first]) for b in _near(flat[other])),
                           key=lambda ab: (abs(ab[0] - flat[first]) + abs(ab[1] - flat[other]), ab))
            hit = next(((a, b) for a, b in pairs if ok({first: a, other: b})), None)
            if hit:
                offers.append(("set " if not offers else "") + f"{first}={hit[0]} and {other}={hit[1]}")
                if len(offers) == shown - 1:
                    break
    if not offers and progress is not None:
        out = searched_fix(line, flat, fix_fields, progress, shown=shown)
        if out != line:
            return out
        others = [n for n in dict.fromkeys(also) if n not in fix_fields[param]]
        return (f"{head}; fix: no value of {param} alone passes every rule here"
                + (f": change it together with {' and '.join(others)} (see the other problems)" if others else ""))
    return f"{head}; fix: {' or '.join(offers)}" if offers else line


def _near(value: int, span: int = 6) -> list[int]:
    return sorted(set(range(1, max(span, value + span // 2) + 1)) | {2 * value})


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
