"""The packages of ``src/cpattn`` import each other without a loop.

Each top-level package (or module) is a node; an edge is an ``import cpattn.X`` / ``from cpattn.X import``
anywhere in a file of the package, inside functions too, or a string naming a module ``"cpattn.X..."``
(``"cpattn.X.y:name"``), as a registry that imports by name holds it (read from the source, nothing is
imported). Left out, by design: the old paths kept for one release, each a module whose docstring says so
("Old path of", "Deprecated path", "Deprecated old path") and which the library never imports.
"""

from __future__ import annotations

import ast
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "cpattn"
OLD_PATH = ("Old path of", "Deprecated path", "Deprecated old path")
NAMED = re.compile(r"^cpattn(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?$")  # a module named in a string (a registry's entry)


def named_modules(tree: ast.AST) -> list[tuple[str, int]]:
    """The modules a file names in strings, as a registry importing by name holds them: [(module, line)]."""
    return [(n.value.split(":")[0], n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAMED.match(n.value)]


def package(parts: tuple[str, ...]) -> str:
    return parts[0].removesuffix(".py") if parts else "__init__"


def edges() -> dict[str, dict[str, list[str]]]:
    """{package: {package it imports: [file:line, ...]}} over the library's files, old paths left out."""
    out: dict[str, dict[str, list[str]]] = {}
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC)
        tree = ast.parse(f.read_text())
        doc = ast.get_docstring(tree) or ""
        if doc.startswith(OLD_PATH):
            continue
        src = package(rel.parts)
        found = named_modules(tree)
        for node in ast.walk(tree):
            mods = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [(m, node.lineno) for m in mods]
        for m, line in found:
            if m.startswith("cpattn."):
                dst = package(tuple(m.split(".")[1:]))
                if dst != src:
                    out.setdefault(src, {}).setdefault(dst, []).append(f"{rel}:{line}")
    return out


def loops(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_loop():
    assert loops({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]
    assert loops({"a": {"b": []}, "b": {}}) == []


def test_a_registry_naming_a_module_is_an_edge():
    tree = ast.parse('R = {"ngram": "cpattn.drafters.ngram:NgramDrafter"}\nx = "cpattn is fast"')
    assert named_modules(tree) == [("cpattn.drafters.ngram", 1)]


def test_no_package_loop():
    graph = edges()
    assert {"engine", "v4", "models", "layout"} <= set(graph)  # the walk read the library
    found = loops(graph)
    detail = {(a, b): graph[a][b][:3] for comp in found for a in comp for b in graph.get(a, {}) if b in comp}
    assert found == [], detail


def test_the_old_paths_left_out_are_leaves():
    """Nothing in the library imports an old path (so leaving them out hides no edge the library runs)."""
    old = set()
    for f in SRC.rglob("*.py"):
        if (ast.get_docstring(ast.parse(f.read_text())) or "").startswith(OLD_PATH):
            old.add("cpattn." + ".".join(f.relative_to(SRC).with_suffix("").parts))
    assert len(old) >= 10
    users = []
    for f in SRC.rglob("*.py"):
        tree = ast.parse(f.read_text())
        if (ast.get_docstring(tree) or "").startswith(OLD_PATH):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in old:
                users.append(f"{f.relative_to(SRC)}:{node.lineno} {node.module}")
    assert users == []
