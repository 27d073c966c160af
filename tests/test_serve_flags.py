"""``cpattn serve``'s layout / graph / speculative / checkpoint flags, and the README's serve + curl commands.

The refusals run in-process (one line on stderr, exit 2, before any engine is built); the served
layouts start the real server in a subprocess and are talked to by the real ``openai`` client, every
token compared with one-device greedy generation of the same weights. Servers take seconds to start
on shared cores, so those tests are slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from cpattn.serve import cli as serve_cli
from serve_helpers import ids as _ids  # noqa: F401 - test_serve imports it from here

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
GRAPH = '{"cudagraph_mode": "FULL_DECODE_ONLY"}'
NGRAM = '{"method": "ngram", "num_speculative_tokens": 2}'
P1 = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
P2 = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repetitive: n-gram drafts get accepted

needs_serving = pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in ("openai", "fastapi", "uvicorn")),
                                   reason="openai / fastapi / uvicorn not installed (the dev extra has them)")


def _refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        serve_cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv,said", [
    (["--pcp", "3", "--dcp", "2"], ["--prefill-context-parallel-size", "saw --pcp=3 with --dcp=2",
                                    "--pcp is 1 or equals --dcp", "use --pcp 2"]),
    (["--pcp", "2"], ["saw --pcp=2 with --dcp=1", "use --pcp 2 --dcp 2"]),
    (["--compilation-config", "{cudagraph_mode: FULL}"], ["--compilation-config", "not JSON"]),
    (["--compilation-config", '["FULL_DECODE_ONLY"]'], ["--compilation-config", "a JSON list"]),
    (["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}'], ["cudagraph_mode=\"PIECEWISE\"",
                                                                 "NONE, FULL_DECODE_ONLY"]),
    (["--compilation-config", '{"cudagraph_mod": "FULL_DECODE_ONLY"}'], ["saw key 'cudagraph_mod'", "cudagraph_mode"]),
    (["--compilation-config", '{"cudagraph_capture_sizes": [0]}'], ["cudagraph_capture_sizes=[0]"]),
    (["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 1}'], ["method=\"eagle3\"",
                                                                                    "ngram, mtp only", "trained head"]),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'], ['method "mtp" with the embedded',
                                                                                 "add --model DIR"]),
    (["--speculative-config", '{"method": "ngram"}'], ["no num_speculative_tokens"]),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'], ["num_speculative_tokens=-1"]),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}'], ["saw key 'k'"]),
    (["--model", "/nonexistent/ckpt"], ["argument --model", "/nonexistent/ckpt", "not a directory"]),
])
def test_bad_layout_graph_speculative_and_model_flags_exit_2(argv, said, capsys):
    err = _refusal([*argv, "--port", str(_free_port())], capsys)
    assert err.startswith("cpattn serve: error: argument --"), err
    for piece in said:
        assert piece in err, (piece, err)


def test_model_dir_without_weights_exits_2(tmp_path, capsys):
    from cpattn.models import qwen3

    (tmp_path / "config.json").write_text(json.dumps(qwen3.Qwen3Config.tiny().to_hf()))
    err = _refusal(["--model", str(tmp_path)], capsys)
    assert "argument --model" in err and "safetensors" in err, err


def _hybrid_checkpoint(path, mtp: bool):
    """A tiny Qwen3-Next checkpoint (float64 weights) with, or without, a random MTP module (``mtp.*``)."""
    import torch

    from cpattn.drafters import checkpoint
    from cpattn.drafters.qwen3_next_mtp import Qwen3NextMTPDrafter
    from cpattn.models import qwen3_next as qn

    cfg = qn.Qwen3NextConfig.tiny()
    params = qn.init_params(cfg, seed=1, std=0.2, dtype=torch.float64)
    head = Qwen3NextMTPDrafter.random(cfg, params, seed=3).params if mtp else {}
    checkpoint.save(path, checkpoint.unstack_experts({**params, **head}),
                    {**cfg.to_hf(), "mtp_num_hidden_layers": int(mtp)})
    return cfg, params


def test_mtp_from_a_checkpoint_without_one_exits_2(tmp_path, capsys):
    _hybrid_checkpoint(tmp_path, mtp=False)
    err = _refusal(["--model", str(tmp_path), "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
                    "--port", str(_free_port())], capsys)
    assert "declares no MTP module" in err, err


def test_mtp_drafts_from_the_served_checkpoint(one_device, tmp_path):
    """--speculative-config mtp builds the checkpoint's own MTP drafter: drafts are verified, and the tokens
    are the same as without drafts (speculative decoding is lossless): the one-device greedy recompute's."""
    from cpattn.engine.llm import SamplingParams

    cfg, params = _hybrid_checkpoint(tmp_path, mtp=True)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    runs = {}
    for spec in (None, '{"method": "mtp", "num_speculative_tokens": 2}'):
        argv = ["--model", str(tmp_path), "--dtype", "float64", *(["--speculative-config", spec] if spec else [])]
        a = serve_cli.parser().parse_args(argv)
        engine = serve_cli.build_engine(a, serve_cli.check_args(a))
        outs = engine.generate(prompts, SamplingParams(max_tokens=8))
        runs[spec is not None] = ([list(o.token_ids) for o in outs], engine.stats.drafted_tokens,
                                  engine.proposer is not None and engine.proposer.hidden_layers is not None)
    assert runs[True][0] == runs[False][0] == [one_device.tokens("qwen3_next", params, cfg, q, 8) for q in prompts]
    assert runs[True][1] > 0 and runs[False][1] == 0
    assert runs[True][2] and not runs[False][2]  # the drafter reads the target's hidden states: the MTP head


def test_flags_reach_the_engine_arguments():
    """Accepted values parse to what build_engine hands the LLMEngine."""
    a = serve_cli.parser().parse_args(["--pcp", "2", "--dcp", "2", "--compilation-config",
                                       '{"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [3, 6]}',
                                       "--speculative-config", '{"method": "NGRAM", "num_speculative_tokens": 2, '
                                                               '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'])
    assert (a.prefill_context_parallel_size, a.decode_context_parallel_size) == (2, 2)
    assert a.compilation_config == {"graph_mode": "FULL_DECODE_ONLY", "capture_sizes": (3, 6), "graph_backend": "auto"}
    assert a.speculative_config == {"method": "ngram", "num_speculative_tokens": 2, "max_ngram": 4, "min_ngram": 2}
    assert serve_cli.check_args(a).max_num_batched_tokens == 2048


# ----------------------------------------------------------------------------- served layouts
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in r.read().decode().splitlines()
                                         if ln and not ln.startswith("#"))}


def ask_concurrently(client, name: str, jobs: dict, timeout: float) -> tuple[dict, list]:
    """Each job ``key: (prompt, max_tokens, stream)`` sent greedy (``temperature=0``) from its own thread at
    once; waits up to ``timeout`` s each. Returns ({key: token ids}, the exceptions raised)."""
    import threading

    got, errors = {}, []

    def ask(key, prompt, n, stream):
        try:
            if stream:
                got[key] = sum((_ids(c.choices[0]) for c in client.completions.create(
                    model=name, prompt=prompt, max_tokens=n, stream=True, temperature=0) if c.choices), [])
            else:
                got[key] = _ids(client.completions.create(model=name, prompt=prompt, max_tokens=n,
                                                          temperature=0).choices[0])
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(k, *v)) for k, v in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return got, errors


def sigterm_mid_stream(client, name: str, prompt: list[int], n: int, proc) -> list[int]:
    """Stream ``n`` greedy tokens of ``prompt`` from a thread; once the first arrive (fewer than ``n``), SIGTERM
    the server ``proc``; returns every token the stream got (draining servers finish it: the whole answer)."""
    import threading

    got, errors = [], []

    def ask():
        try:
            for c in client.completions.create(model=name, prompt=prompt, max_tokens=n, stream=True, temperature=0):
                got.extend(_ids(c.choices[0]) if c.choices else [])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.monotonic() + 60
    while not got:
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.02)
    assert len(got) < n
    proc.send_signal(signal.SIGTERM)  # mid-generation
    t.join(120)
    assert not errors, errors
    return got


class Served:
    """A ``cpattn serve`` subprocess on 127.0.0.1 (SIGTERM at the end must exit 0)."""

    def __init__(self, argv: list[str], port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=ROOT)
        deadline = time.monotonic() + 240
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"{shlex.join(argv)} exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{shlex.join(argv)} did not answer /health within 240 s")
            time.sleep(0.25)

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="x", max_retries=0, timeout=120)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("cpattn serve did not exit within 30 s of SIGTERM") from None
        return self.proc.returncode


@pytest.fixture(scope="module")
def embedded():
    """(family, cfg, params) of the embedded model every server of this file builds (seed 0)."""
    from cpattn.bench.demo_setup import Spec, load_model

    return load_model(Spec(model_type="qwen3"))


def _greedy(embedded, prompt: list[int], n: int) -> list[int]:
    """One-device greedy tokens: conftest.py's ``one_device`` recompute (a fresh full prefill per token)."""
    from ref.greedy import ONE_DEVICE

    family, cfg, params = embedded
    return ONE_DEVICE.tokens(family, params, cfg, prompt, n)


def _readme_serve_block() -> tuple[str, str]:
    """(the serve command, the curl command) of the README's serve example."""
    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "curl" in b and "cpattn serve" in b)
    lines = [ln.split("#", 1)[0].strip() for ln in block.replace("\\\n", " ").splitlines()]
    serve = next(ln for ln in lines if ln.startswith("cpattn serve"))
    curl = next(ln for ln in lines if ln.startswith("curl"))
    return serve.rstrip("& "), curl


@pytest.mark.slow
@needs_serving
def test_readme_serve_command_and_curl_then_openai_client_under_pcp_and_dcp(embedded):
    """The README's `cpattn serve --pcp 2 --dcp 2` command and its `curl` example, as written (the port
    swapped for a free one), then the openai client on the same server: tokens equal one device."""
    serve, curl = _readme_serve_block()
    assert "--pcp 2" in serve and "--dcp 2" in serve, serve
    port = _free_port()
    argv = [sys.executable, "-m", "cpattn", *shlex.split(serve)[1:]]
    argv = [str(port) if a == "8000" else a for a in argv]
    assert str(port) in argv, f"the README's serve command has no --port 8000: {serve}"
    srv = Served(argv, port)
    try:
        out = subprocess.run(shlex.split(curl.replace("8000", str(port))), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        prompt, n = body_prompt(curl)
        assert body["choices"][0]["token_ids"] == _greedy(embedded, prompt, n)
        r = srv.client().completions.create(model="cpattn-qwen3", prompt=[P1, P2], max_tokens=6, temperature=0)
        got = [list(c.model_extra["token_ids"]) for c in sorted(r.choices, key=lambda c: c.index)]
        assert got == [_greedy(embedded, P1, 6), _greedy(embedded, P2, 6)]
        stream = srv.client().completions.create(model="cpattn-qwen3", prompt=P1, max_tokens=5, stream=True,
                                                 temperature=0)
        chunks = [list(c.choices[0].model_extra["token_ids"]) for c in stream if c.choices]
        assert sum(chunks, []) == _greedy(embedded, P1, 5) and len(chunks) >= 2
    finally:
        assert srv.stop() == 0, srv.proc.stderr.read()


def body_prompt(curl: str) -> tuple[list[int], int]:
    """The prompt and max_tokens of the README's curl body."""
    body = json.loads(shlex.split(curl)[shlex.split(curl).index("-d") + 1])
    return body["prompt"], body["max_tokens"]


def _save_checkpoint(path: pathlib.Path, embedded) -> None:
    """The embedded weights as a checkpoint directory, with a word-level tokenizer.json: word "w{i}" is id i."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, cfg, params = embedded
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file({k: v.contiguous() for k, v in params.items()}, str(path / "model.safetensors"))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def _words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_unreadable_tokenizer_exits_2(tmp_path, embedded, capsys):
    ckpt = tmp_path / "ckpt"
    _save_checkpoint(ckpt, embedded)
    (ckpt / "tokenizer.json").write_text("{not a tokenizer")
    err = _refusal(["--model", str(ckpt)], capsys)
    assert "argument --model" in err and "tokenizer.json is not a readable tokenizers file" in err, err


@pytest.mark.slow
@needs_serving
def test_checkpoint_dir_captured_decode_and_ngram_drafts_serve_exact_tokens(tmp_path, embedded):
    """--model DIR (served under its path), FULL_DECODE_ONLY and n-gram drafts on DCP 2: the tokens equal
    one device, and /metrics shows replayed (captured) steps beside eager ones. The directory's
    tokenizer.json makes text prompts work and every text the decoded tokens (streamed: the chunks
    concatenate to it)."""
    ckpt = tmp_path / "tiny-qwen3"
    _save_checkpoint(ckpt, embedded)
    port = _free_port()
    srv = Served([sys.executable, "-m", "cpattn", "serve", "--model", str(ckpt), "--dcp", "2", "--block-size", "4",
                  "--max-num-batched-tokens", "8", "--max-model-len", "256", "--compilation-config", GRAPH,
                  "--speculative-config", NGRAM, "--port", str(port)], port)
    try:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == [str(ckpt)]
        before = _metrics(srv.base)
        r = client.completions.create(model=str(ckpt), prompt=[P1, P2], max_tokens=8, temperature=0)
        got = [list(c.model_extra["token_ids"]) for c in sorted(r.choices, key=lambda c: c.index)]
        assert got == [_greedy(embedded, P1, 8), _greedy(embedded, P2, 8)]
        stream = client.completions.create(model=str(ckpt), prompt=P2, max_tokens=8, stream=True, temperature=0)
        assert sum((list(c.choices[0].model_extra["token_ids"]) for c in stream if c.choices), []) == \
            _greedy(embedded, P2, 8)
        want = [_greedy(embedded, P1, 8), _greedy(embedded, P2, 8)]
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [_words(w) for w in want]
        r = client.completions.create(model=str(ckpt), prompt=_words(P2), max_tokens=8, temperature=0)
        assert list(r.choices[0].model_extra["token_ids"]) == want[1] and r.choices[0].text == _words(want[1])
        assert r.usage.prompt_tokens == len(P2)
        stream = client.completions.create(model=str(ckpt), prompt=[_words(P1)], max_tokens=8, stream=True,
                                           temperature=0)
        assert "".join(c.choices[0].text for c in stream if c.choices) == _words(want[0])
        after = _metrics(srv.base)
        assert after["cpattn_replayed_steps_total"] > before["cpattn_replayed_steps_total"], after
        assert after["cpattn_eager_steps_total"] > before["cpattn_eager_steps_total"], after  # the prefills
    finally:
        assert srv.stop() == 0, srv.proc.stderr.read()
