"""Bad command lines end before any rank starts: exit 2 and one line on stderr naming the flag, no traceback.

The table runs in one helper process that imports the CLI once and forks a
child per case (each case is its own process, as from a shell, but costs
milliseconds instead of an ``import torch``); two cases also run as
``python -m cpattn.cli``. Also: ``--json -`` puts only JSON on stdout, and
progress output in a log (stderr not a terminal) has no ``\\r`` updates.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()  # --backend cuda is refused only where there is no GPU
NPU = importlib.util.find_spec("torch_npu") is not None

CASES = [  # argv, what the one line must name
    (["prefill", "--heads", "6", "--kv-heads", "4"], "--kv-heads"),
    (["prefill", "--kv-heads", "0"], "--kv-heads"),
    (["prefill", "--seq-lens", "5,-3"], "--seq-lens"),
    (["prefill", "--seq-lens", "5,x"], "--seq-lens"),
    (["prefill", "--pcp", "0"], "--pcp"),
    (["prefill", "--prefill-context-parallel-size", "-1"], "--prefill-context-parallel-size"),
    (["prefill", "--dtype", "bf17"], "--dtype"),
    (["prefill", "--timeout", "0"], "--timeout"),
    (["prefill", "--head-dim", "0"], "--head-dim"),
    (["prefill", "--method", "zigzag"], "--method"),
    (["prefill", "--bogus"], "--bogus"),
    (["bench", "pcp", "--quick", "--kv-heads", "3"], "--kv-heads"),
    (["bench", "graph", "--quick", "--dcp", "3"], "--dcp"),
    (["bench", "graph", "--dcp", "0"], "--dcp"),
    (["bench", "graph", "--backend", "nonsense"], "--backend"),
    (["bench", "graph", "--block-size", "16", "--cp-kv-cache-interleave-size", "5"], "--cp-kv-cache-interleave-size"),
    (["bench", "graph", "--head-dim", "7"], "--head-dim"),
    (["bench", "graph", "--batches", "0,2"], "--batches"),
    (["bench", "dcp", "--dcp", "3"], "--dcp"),
    (["bench", "dcp", "--dcp", "1"], "--dcp"),
    (["bench", "dcp", "--dtype", "int8"], "--dtype"),
    (["bench", "comm", "--world-size", "1"], "--world-size"),
    (["bench", "comm", "--sizes", "0"], "--sizes"),
    (["bench", "dsa", "--tp", "1"], "--tp"),
    (["bench", "paged", "--reps", "0"], "--reps"),
    (["bench", "spec", "--pcp", "0"], "--pcp"),
    (["bench", "spec", "--timeout", "-1"], "--timeout"),
    (["bench", "pool", "--prompt-len", "0"], "--prompt-len"),
    (["bench", "mlapo", "--dcp-sizes", "3"], "--dcp-sizes"),
    (["bench", "mlapo", "--graph-backend", "nonsense"], "--graph-backend"),
    (["pool", "serve", "--port", "70000"], "--port"),
    (["pool", "serve", "--memory", "3x"], "--memory"),
    (["demo", "--pcp", "2", "--dcp", "3"], "--dcp"),
    (["demo", "--model-type", "nonsense"], "--model-type"),
    (["demo", "--kv-pool", "redis:x"], "--kv-pool"),
    (["demo", "--model-type", "deepseek_v4", "--kv-pool", "lmdb:/tmp/cpattn-unused"], "--kv-pool"),
    (["demo", "--backend", "nonsense"], "--backend"),
    (["demo", "--capture-sizes", "0"], "--capture-sizes"),
    (["demo", "--block-size", "16", "--cp-kv-cache-interleave-size", "5"], "interleave"),
    (["demo", "--model", "{models}/missing"], "is not a directory"),
    (["demo", "--model", "{models}/no_config"], "has no config.json"),
    (["demo", "--model", "{models}/no_weights"], "has no *.safetensors"),
    (["demo", "--model", "{models}/bad_json"], "is not valid JSON"),
    (["demo", "--model", "{models}/lacks_keys"], "lacks 'vocab_size'"),
    (["demo", "--model", "{models}/other_family"], "model_type 'llama' is not supported"),
    (["demo", "--model", "{models}/bad_weights"], "is not a readable safetensors file"),
    (["train-draft", "--method", "medusa", "--model", "{models}/missing", "--out", "{models}/out"], "--method"),
    (["train-draft", "--method", "mtp", "--model", "{models}/missing", "--out", "{models}/out"], "--model"),
    (["train-target", "--model", "qwen3", "--out", "{models}/out", "--hidden", "30"], "--hidden"),
    (["bench", "drafts", "--reps", "0"], "--reps"),
    (["bench", "drafts", "--backend", "nonsense"], "--backend"),
    (["bench", "drafts", "--data", "/nonexistent"], "--data"),
    # every output path, input file and device is checked before any work (one line, exit 2)
    (["demo", "--json", "{models}/no_such_dir/out.json"], "--json"),
    (["demo", "--json", "{models}"], "--json"),
    (["prefill", "--json", "{models}/no_such_dir/out.json"], "--json"),
    (["bench", "pcp", "--json", "{models}/no_config/model.safetensors/out.json"], "--json"),
    (["bench", "drafts", "--json", "{models}/no_such_dir/out.json"], "--json"),
    (["plan", "--json", "{models}/no_such_dir/out.json"], "--json"),
    (["plan", "calibrate", "--out", "{models}/no_config/model.safetensors/cpu.json"], "--out"),
    (["plan", "calibrate", "--out", "{models}"], "--out"),
    (["plan", "validate", "--pcp-json", "{models}/missing.json"], "--pcp-json"),
    (["plan", "validate", "--graph-json", "{models}"], "--graph-json"),
    (["plan", "validate", "--dcp-json", "{models}/bad_json/config.json"], "--dcp-json"),
    (["plan", "validate", "--dcp-json", "{models}/no_weights/config.json"], "--dcp-json"),
    (["plan", "--model", "{models}/missing/config.json"], "--model"),
    (["demo", "--backend", "gpu"], "--backend"),
    *([] if NPU else [(["demo", "--backend", "npu"], "torch_npu"), (["bench", "graph", "--backend", "torchair"],
                                                                     "torch_npu")]),
    *([] if CUDA else [(["demo", "--backend", "cuda"], "CUDA"), (["bench", "graph", "--backend", "cuda"], "CUDA"),
                       (["bench", "mlapo", "--graph-backend", "cuda"], "CUDA"),
                       (["bench", "drafts", "--backend", "cuda"], "CUDA")]),
    (["nonsense"], "'nonsense'"),
    (["bench", "nonsense"], "'nonsense'"),
    (["bench"], "benchmark"),
]

# imports the CLI (and what its checks import) once, then forks one child per case: stdout/stderr to files, a 30 s alarm
RUNNER = r"""
import importlib, json, os, signal, sys, tempfile, time, traceback
import cpattn.cli as cli
for target, _ in [*cli.COMMANDS.values(), *(v for t in cli.GROUPS.values() for v in t.values())]:
    try:  # preload, so each case costs milliseconds; a module that fails to import fails its own cases
        importlib.import_module(target.split(":")[0])
    except Exception:
        pass
# and what the demo's checks import once the flags parse (torch, the engine's configs): each forked case would
# otherwise import torch again (~5 s a case on 2 shared cores); a case that starts a rank still spawns a fresh
# process that imports torch itself, so "seconds < 10" below still means "refused before any rank starts"
import torch, cpattn.bench.demo_run, cpattn.engine.checks, cpattn.v4  # noqa: E401,F401
results = []
for argv in json.load(sys.stdin):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                code = cli.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        results.append({"argv": argv, "code": os.waitstatus_to_exitcode(status), "seconds": seconds,
                        "stdout": out.read().decode(), "stderr": err.read().decode()})
print(json.dumps(results))
"""


def _env():
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}


QWEN3 = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def broken_checkpoints(root):
    """Checkpoint directories each broken in one way (the demo reads config.json and the weights' headers)."""
    files = {
        "no_config": {"model.safetensors": ""},
        "no_weights": {"config.json": json.dumps(QWEN3)},
        "bad_json": {"config.json": "{not json", "model.safetensors": ""},
        "lacks_keys": {"config.json": json.dumps({"model_type": "qwen3"}), "model.safetensors": ""},
        "other_family": {"config.json": json.dumps({**QWEN3, "model_type": "llama"}), "model.safetensors": ""},
        "bad_weights": {"config.json": json.dumps(QWEN3), "model.safetensors": "garbage"},
    }
    for name, content in files.items():
        (root / name).mkdir()
        for f, text in content.items():
            (root / name / f).write_text(text)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    broken_checkpoints(models)
    argvs = [[a.replace("{models}", str(models)) for a in argv] for argv, _ in CASES]
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr
    return {tuple(argv): r for (argv, _), r in zip(CASES, json.loads(proc.stdout))}


@pytest.mark.slow
@pytest.mark.parametrize("argv, names", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_invocation_is_one_line_exit_2(results, argv, names):
    r = results[tuple(argv)]
    lines = r["stderr"].strip().splitlines()
    assert r["code"] == 2, r
    assert len(lines) == 1 and "Traceback" not in r["stderr"], r["stderr"]
    assert names in lines[0] and "error" in lines[0], lines[0]
    assert r["stdout"] == "", r["stdout"]
    assert r["seconds"] < 10, r  # refused before any rank starts (a rank alone takes seconds to import torch)


def test_bad_invocation_from_a_shell():
    proc = subprocess.run([sys.executable, "-m", "cpattn.cli", "prefill", "--seq-lens", "5,-3"], capture_output=True,
                          text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and proc.stdout == "", proc
    (line,) = proc.stderr.strip().splitlines()
    assert "--seq-lens" in line and "-3" in line and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_json_dash_is_pure_json_and_a_log_gets_no_progress_updates():
    argv = ["prefill", "--seq-lens", "40,9", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--reps", "1",
            "--json", "-"]
    proc = subprocess.run([sys.executable, "-m", "cpattn.cli", *argv], capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # nothing but JSON on stdout
    assert result["exact"] is True and result["world_size"] == 2
    assert "exact vs single rank" in proc.stderr  # the text report went to stderr
    assert "\r" not in proc.stderr and max(len(line) for line in proc.stderr.splitlines()) < 400


def _parsers():
    """Every command's parser (cpattn COMMAND and cpattn GROUP NAME), captured as its main() parses."""
    from cpattn import cli as top
    from cpattn.bench import args as cli

    seen = []

    class Stop(Exception):
        pass

    def grab(self, argv=None, namespace=None):
        seen.append(self)
        raise Stop

    targets = [t for t, _ in [*top.COMMANDS.values(), *(v for g in top.GROUPS.values() for v in g.values())]]
    original = cli.Parser.parse_args
    cli.Parser.parse_args = grab
    try:
        for target in targets:
            with pytest.raises(Stop):
                top._load(target)([])
    finally:
        cli.Parser.parse_args = original
    assert len(seen) == len(targets)
    return seen


def test_every_option_has_help_showing_its_default_and_no_work_item_numbers():
    import argparse

    for p in _parsers():
        text = p.format_help()
        assert "issue" not in text.lower() and "item " not in text.lower(), p.prog
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (p.prog, action.option_strings)
        for action in p._actions:  # every option states its default, on/off switches aside
            if not isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction)):
                assert "default" in p._get_formatter()._get_help_string(action), (p.prog, action.option_strings)
        assert "(default: False)" not in text and ") (default: None)" not in text, p.prog


def test_parallel_flags_take_vllm_names_short_aliases_and_any_dtype_spelling():
    from cpattn.bench import args as cli

    p = cli.parser("cpattn t", "t")
    cli.add_parallel(p, tp=1, pcp=1, dcp=1, interleave=1, block_size=16)
    cli.add_dtype(p)
    long = p.parse_args(["--tensor-parallel-size", "4", "--prefill-context-parallel-size", "2",
                         "--decode-context-parallel-size", "2", "--cp-kv-cache-interleave-size", "8",
                         "--block-size", "64", "--dtype", "bfloat16"])
    short = p.parse_args(["--tp", "4", "--pcp", "2", "--dcp", "2", "--cp-kv-cache-interleave-size", "8",
                          "--block-size", "64", "--dtype", "bf16"])
    assert vars(long) == vars(short) == {
        "tensor_parallel_size": 4, "prefill_context_parallel_size": 2, "decode_context_parallel_size": 2,
        "cp_kv_cache_interleave_size": 8, "block_size": 64, "dtype": "bfloat16"}
    for spelling, name in [("fp32", "float32"), ("float16", "float16"), ("fp16", "float16"), ("fp64", "float64")]:
        assert p.parse_args(["--dtype", spelling]).dtype == name


def test_a_failed_rank_is_one_message_exit_1_without_the_launchers_traceback(monkeypatch, capsys):
    from cpattn import cli
    from cpattn.comm.launch import SpawnError

    def failing(argv):
        raise SpawnError("spawn(2, f): rank 1 stopped responding (no heartbeat for 30 s; process state: stopped)")

    monkeypatch.setattr(cli, "_load", lambda target: failing)
    assert cli.main(["prefill"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cpattn prefill: spawn(2, f): rank 1 stopped responding") and "Traceback" not in err
