"""The planner's experiments moved beside the benchmarks (``cpattn.bench.perf``): the old module paths still
import for one minor release, warn ``DeprecationWarning`` naming the new path and hand out the very same
objects; and the planner's library imports nothing from ``cpattn.bench`` (read from the source, not run)."""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys
import warnings

import pytest

import cpattn

MOVED = {  # old path -> (new path, names the old module had)
    "cpattn.plan.calibrate": ("cpattn.bench.perf.calibrate", ["calibrate", "summary", "fit_alpha_beta", "_cpu",
                                                             "comm_part", "attention_case", "ATTN_SIZES"]),
    "cpattn.plan.calibrate_comm": ("cpattn.bench.perf.calibrate_comm", ["comm_part", "comm_rank", "_host_work"]),
    "cpattn.plan.anchors": ("cpattn.bench.perf.anchors", ["pcp_anchor", "dcp_anchor", "v4_anchor", "PCP_PUBLISHED",
                                                         "pcp_terms", "ttft_terms"]),
    "cpattn.plan.anchor_terms": ("cpattn.bench.perf.anchor_terms", ["pcp_terms", "ttft_terms"]),
    "cpattn.plan.validate": ("cpattn.bench.perf.validate", ["table", "measured_pcp", "where_the_model_earns_its_keep"]),
    "cpattn.plan.cli_tools": ("cpattn.bench.perf.cli", ["_calibrate", "_validate", "_anchors"]),
}
# the predictors (and the op counter) stayed in the library: cpattn.plan.validate hands them out from there
STAYED = {"cpattn.plan.bench_model": ["predict_pcp", "predict_dcp", "predict_graph", "profile_gaps",
                                      "concurrent_share", "_attn"],
          "cpattn.plan.opcount": ["EchoGroup", "count_ops", "demo_step"]}


def _fresh(name: str):
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(name)
    return mod, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_with_the_new_path_and_gives_the_same_objects(old):
    new, names = MOVED[old]
    mod, warned = _fresh(old)
    assert len(warned) == 1 and new in str(warned[0].message) and "deprecated" in str(warned[0].message)
    assert not warned[0].filename.endswith(f"plan/{old.rsplit('.', 1)[1]}.py")  # it points at the importer
    target = importlib.import_module(new)
    for n in names:
        assert getattr(mod, n) is getattr(target, n), n
    with pytest.raises(AttributeError, match=new.replace(".", r"\.")):
        mod.no_such_name  # noqa: B018


@pytest.mark.parametrize("new", sorted(STAYED))
def test_validate_hands_out_the_library_predictors(new):
    names = STAYED[new]
    mod, _ = _fresh("cpattn.plan.validate")
    target = importlib.import_module(new)
    for n in names:
        assert getattr(mod, n) is getattr(target, n), n


SRC = pathlib.Path(cpattn.__file__).parent
SHIMS = {"calibrate.py", "calibrate_comm.py", "anchors.py", "anchor_terms.py", "validate.py", "cli_tools.py"}
CLI = set()  # the planner's command line too: `cpattn plan calibrate|validate|anchors` goes there from cpattn.cli


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_the_planner_library_imports_nothing_from_bench():
    files = sorted(p for p in (SRC / "plan").glob("*.py") if p.name not in SHIMS | CLI | {"_experiments_moved.py"})
    assert {"cli.py", "model.py", "profiles.py", "specs.py", "costs.py", "bench_model.py", "breakeven.py"} <= {p.name for p in files}
    upward = {p.name: sorted(m for m in _imports(p) if m == "cpattn.bench" or m.startswith("cpattn.bench."))
              for p in files}
    assert {k: v for k, v in upward.items() if v} == {}


def test_the_shims_are_only_forwarders():  # nothing but the warning and the forwarding lives at the old paths
    for name in SHIMS:
        tree = ast.parse((SRC / "plan" / name).read_text())
        defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert defs == ["__getattr__"], (name, defs)


def test_the_experiments_through_the_planners_main_warn_and_still_run(capsys):
    from cpattn.bench.perf.cli import main as experiments
    from cpattn.cli import main as command_line
    from cpattn.plan.cli import main

    with pytest.warns(DeprecationWarning, match=r"moved to cpattn\.bench\.perf\.cli\.main"):
        assert main(["anchors", "--json", "-"]) == 0
    old = capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # `cpattn plan anchors` goes to the new one directly
        assert command_line(["plan", "anchors", "--json", "-"]) == 0
        new = capsys.readouterr().out
        assert experiments(["anchors", "--json", "-"]) == 0
    assert old == new == capsys.readouterr().out and '"llama"' in new
