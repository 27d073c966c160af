"""How spawn starts its ranks: forked from a forkserver that imported torch once (fast), yet each rank sees this
process's environment, import path and directory as they are at the spawn, as a spawned process would."""

from __future__ import annotations

import os
import sys

import pytest

from cpattn.comm import launch


def where(group):
    return group.rank, os.environ.get("CPATTN_TEST_MARK"), os.getcwd(), sys.path[-1]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_see_this_processs_environment_path_and_directory_now(method, monkeypatch, tmp_path):
    monkeypatch.setenv("CPATTN_START_METHOD", method)
    assert launch.start_method() == method
    launch.spawn(2, where)  # the forkserver (if any) starts here, before the changes below
    monkeypatch.setenv("CPATTN_TEST_MARK", f"set after the first spawn ({method})")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = str(tmp_path / "last")
    monkeypatch.setattr(sys, "path", [*sys.path, extra])
    got = launch.spawn(2, where)
    assert got == [(r, f"set after the first spawn ({method})", str(tmp_path), extra) for r in range(2)]


def test_an_unknown_start_method_is_refused(monkeypatch):
    monkeypatch.setenv("CPATTN_START_METHOD", "fork")
    with pytest.raises(ValueError, match="CPATTN_START_METHOD='fork'; use forkserver or spawn"):
        launch.start_method()
