"""Every entry point a user imports first must import on its own: a fresh ``sys.modules`` per entry, so an
import cycle that only bites in one order (``cpattn.models.deepseek_v4`` before ``cpattn.engine``) shows."""

from __future__ import annotations

import subprocess
import sys

import pytest

ENTRIES = ["cpattn", "cpattn.engine", "cpattn.serve", "cpattn.plan", "cpattn.lab", "cpattn.drafters", "cpattn.v4",
           "cpattn.dsa", "cpattn.linear", "cpattn.pool", "cpattn.graphs", "cpattn.bench", "cpattn.models.qwen3",
           "cpattn.models.qwen3_moe", "cpattn.models.qwen3_next", "cpattn.models.qwen3_5", "cpattn.models.deepseek_v2",
           "cpattn.models.deepseek_v3", "cpattn.models.deepseek_v32", "cpattn.models.glm_moe_dsa",
           "cpattn.models.deepseek_v4", "cpattn.engine.runner_v4", "cpattn.engine.run_rank"]

SCRIPT = """
import importlib, sys, warnings
warnings.simplefilter("ignore")
failed = []
for name in sys.argv[1:]:
    for k in [k for k in sys.modules if k == "cpattn" or k.startswith("cpattn.")]:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
"""


@pytest.mark.slow
def test_each_entry_point_imports_on_its_own():
    out = subprocess.run([sys.executable, "-c", SCRIPT, *ENTRIES], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", out.stdout
