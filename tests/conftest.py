import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import ref/ (the oracles) and the *_cases.py modules by name


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.hookimpl(trylast=True)  # after the plugins register their own markers (skipif, parametrize, ...)
def pytest_configure(config):
    """Fail loudly on ``-m`` naming a marker nobody registered (``-m "not slwo"`` would otherwise run everything).

    A misspelt mark in a test file (``@pytest.mark.slwo``) is caught by ``--strict-markers`` in pyproject's addopts.
    """
    import re

    expr = config.option.markexpr or ""
    known = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    unknown = sorted({w for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr) if w not in {"and", "or", "not"}} - known)
    if unknown:
        raise pytest.UsageError(f"-m {expr!r}: unknown marker {', '.join(unknown)}; registered: "
                                f"{', '.join(sorted(known))} (pyproject.toml [tool.pytest.ini_options] markers)")


@pytest.fixture(scope="module")
def one_thread():
    """Run a module with one intra-op thread: simulated ranks are threads on 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
