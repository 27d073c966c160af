import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import ref/ (the oracles) and the *_cases.py modules by name


import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# the lanes' Hypothesis profiles (tests/lanes.py); registered at import so --hypothesis-profile can name them too
settings.register_profile("full", deadline=None)
settings.register_profile("fast", max_examples=25, deadline=None)


@pytest.hookimpl(trylast=True)  # after the plugins register their own markers (skipif, parametrize, ...)
def pytest_configure(config):
    """Fail loudly on ``-m`` naming a marker nobody registered (``-m "not slwo"`` would otherwise run everything);
    then pick the lane's Hypothesis profile (tests/lanes.py).

    A misspelt mark in a test file (``@pytest.mark.slwo``) is caught by ``--strict-markers`` in pyproject's addopts.
    """
    import re

    expr = config.option.markexpr or ""
    known = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    unknown = sorted({w for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr) if w not in {"and", "or", "not"}} - known)
    if unknown:
        raise pytest.UsageError(f"-m {expr!r}: unknown marker {', '.join(unknown)}; registered: "
                                f"{', '.join(sorted(known))} (pyproject.toml [tool.pytest.ini_options] markers)")
    _hypothesis_profile(expr, config.getoption("hypothesis_profile", None))


@pytest.hookimpl(trylast=True)  # after ``-m`` deselected the slow tests: thin what the lane runs
def pytest_collection_modifyitems(config, items):
    """In the fast lane a parametrized test of three or more cases runs a third of them (:func:`lanes.thin`);
    a run naming test ids (``path::name``) or with ``CPATTN_FAST_GRIDS=all`` keeps every case."""
    from lanes import fast_lane, thin

    if not fast_lane() or os.environ.get("CPATTN_FAST_GRIDS") == "all" or any("::" in a for a in config.args):
        return
    kept, dropped = thin(items)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _hypothesis_profile(expr: str, flag: str | None) -> None:
    """``fast`` when ``-m`` deselects a test marked only ``slow``, else ``full``; ``--hypothesis-profile`` or
    ``HYPOTHESIS_PROFILE`` wins. Sets ``HYPOTHESIS_PROFILE`` for :func:`lanes.examples` and loads the profile."""
    from _pytest.mark.expression import Expression

    fast = bool(expr) and not Expression.compile(expr).evaluate(lambda name, **kw: name == "slow")
    name = flag or os.environ.get("HYPOTHESIS_PROFILE") or ("fast" if fast else "full")
    if name not in ("full", "fast"):
        raise pytest.UsageError(f"Hypothesis profile {name!r}: use 'full' (every example) or 'fast' (fewer)")
    os.environ["HYPOTHESIS_PROFILE"] = name
    settings.load_profile(name)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module with one intra-op thread: simulated ranks are threads on 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def one_device():
    """The tests' one-device greedy oracle, one memo per session: ``one_device(family, params, cfg, prompts, n)``
    -> :class:`ref.greedy.Greedy` (tokens [B, N], logits [B, N, V], prompt_logits [T, V]);
    ``one_device.tokens(family, params, cfg, prompt, n)`` -> one prompt's list. Each token is the argmax of a
    fresh full one-device prefill's last row (:mod:`ref.greedy`: no cache carried, no step loop, no engine), keyed
    by the params' content, so tests share an entry only when their weights are bit-equal."""
    from ref.greedy import ONE_DEVICE

    return ONE_DEVICE
