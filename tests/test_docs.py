"""Every python snippet in docs/*.md runs as written (each in a fresh scope), and every ``cpattn`` command the
docs show answers ``--help`` with its own usage; short commands run.

Commands that start long benchmark or training runs are not run here, only their ``--help``: they take minutes
(LONG names them). Snippets that need a server or hardware are listed in SKIP_SNIPPETS with the reason.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import warnings

import pytest


DOCS = sorted((pathlib.Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
SNIPPETS = [(doc.name, i, block) for doc in DOCS
            for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))]
# (file, index) -> why the snippet is not executed here (measured 2026-12-01 on the 2-core CPU machine)
SKIP_SNIPPETS: dict[tuple[str, int], str] = {
    ("graphs.md", 0): "compiles the decode step with inductor: about a minute, beyond this file's budget",
    ("kv_pool.md", 0): "a fragment: it uses the pool the text above opens (tests/test_engine_pool.py runs the API)",
    ("mlapo.md", 0): "a fragment: weights and inputs of a DeepSeek layer come from the text "
                     "(tests/test_mla_preprocess.py runs the op)",
    ("models.md", 0): "needs a real checkpoint directory (path/to/checkpoint); tests/test_models_hf.py loads one",
    ("serve.md", 0): "talks to a running cpattn serve on 127.0.0.1:8000; tests/test_serve.py runs the same calls",
}
# cpattn commands (first words) that run for minutes: only --help is checked
LONG = ("demo", "bench", "train-target", "train-draft", "prefill", "plan", "pool serve")


@pytest.mark.parametrize("name, index, block", SNIPPETS, ids=[f"{n}[{i}]" for n, i, _ in SNIPPETS])
def test_docs_python_snippet_runs_as_written(name, index, block):
    if (name, index) in SKIP_SNIPPETS:
        pytest.skip(SKIP_SNIPPETS[(name, index)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(block, f"docs/{name}[{index}]", "exec"), {})  # noqa: S102 -- our own docs


def test_every_listed_snippet_exists():
    """A snippet named in SKIP_SNIPPETS that the docs no longer have is a stale entry."""
    have = {(n, i) for n, i, _ in SNIPPETS}
    assert not set(SKIP_SNIPPETS) - have


def _commands() -> list[list[str]]:
    out = []
    for doc in [*DOCS, DOCS[0].parents[1] / "README.md"]:
        for tag, block in re.findall(r"```(bash|sh)?\n(.*?)```", doc.read_text(), re.S):
            first = next((x for x in block.splitlines() if x.strip()), "")
            if not tag and not re.match(r"(cpattn |[A-Z]+=)", first):  # an untagged block of prose or formulas
                continue
            for line in block.replace("\\\n", " ").splitlines():  # a continued line is one command
                line = line.split("#")[0].strip()
                if line.startswith("cpattn "):
                    words = shlex.split(line)[1:]
                    out.append([w for w in words if "$" not in w])
    return out


COMMANDS = _commands()


def test_docs_show_commands():
    assert len(COMMANDS) > 5


@pytest.mark.parametrize("words", sorted({tuple(c[:2]) for c in COMMANDS if c}), ids=lambda w: " ".join(w))
def test_every_docs_command_answers_help(words, capsys):
    from cpattn.cli import COMMANDS, GROUPS, _load, main

    if words[0] == "--help":  # cpattn --help: every command
        assert main(["--help"]) == 0 and "train-draft" in capsys.readouterr().out
        return
    if words[0] in GROUPS:
        assert len(words) > 1 and words[1] in GROUPS[words[0]], words
        target = GROUPS[words[0]][words[1]][0]
    else:
        assert words[0] in COMMANDS, words
        target = COMMANDS[words[0]][0]
    with pytest.raises(SystemExit) as e:
        _load(target)(["--help"])
    assert e.value.code == 0, words
    assert "usage" in capsys.readouterr().out.lower(), words
