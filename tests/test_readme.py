"""The README's usage example runs and means what it says; the CLI answers --help."""

import pathlib
import re

import torch

from cpattn.cli import main

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs_and_is_exact(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), scope)  # noqa: S102
    assert torch.allclose(scope["out"], scope["ref"], atol=1e-5)  # the PCP example
    assert torch.allclose(scope["dec"], scope["want"], atol=1e-5)  # the DCP example
    assert torch.equal(scope["gen"].tokens, scope["one"].tokens)  # the engine example: PCP 2 + DCP 2 = one device
    assert scope["gen"].tokens.shape == (2, 8)
    stats = scope["engine"].stats  # the step-loop example: a prefix hit, replays, no leak, the same tokens
    assert (stats.prefix_hit_tokens, stats.blocks_used) == (8, 0) and stats.replayed_steps > 0
    assert scope["engine"].scheduler.output_tokens(scope["first"]) == scope["one"].tokens[0].tolist()


def test_readme_engine_example_runs_alone():
    """The engine snippet runs as written in a fresh session (it imports what it uses, torch included)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    engine = next(b for b in blocks if "engine_configs" in b)
    scope: dict = {}
    exec(compile(engine, str(README), "exec"), scope)  # noqa: S102
    assert torch.equal(scope["gen"].tokens, scope["one"].tokens)


def test_cli_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "prefill" in text and "bench" in text
    assert main(["nope"]) == 2


def test_every_cli_entry_imports_and_answers_help(capsys):
    import pytest

    from cpattn.cli import COMMANDS, GROUPS, _load

    groups = {f"{g} {k}": v for g, cmds in GROUPS.items() for k, v in cmds.items()}
    for name, (target, _) in {**COMMANDS, **groups}.items():
        fn = _load(target)
        with pytest.raises(SystemExit) as e:
            fn(["--help"])
        assert e.value.code == 0, name
        assert "usage" in capsys.readouterr().out.lower(), name
