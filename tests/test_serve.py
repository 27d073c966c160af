"""``cpattn serve``: the real server in a subprocess, talked to by the real ``openai`` client.

One server (embedded tiny Qwen3, DCP 2 on the simulated mesh, an 8-token step budget so prompts are
chunked and concurrent requests share steps) serves the module; every greedy request (``temperature=0``:
the server's default is OpenAI's 1.0) is compared with the one-device greedy recompute
(conftest.py's ``one_device``: a fresh full prefill per token, no engine code) of the same seeded model; seeded sampling must repeat itself. The server's start
(torch, the engine) takes seconds on shared cores, so the file is marked slow; its CLI checks are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import importlib.util

import pytest

for _pkg in ("openai", "fastapi", "uvicorn"):  # present or the module skips; imported only by the tests that use them
    if importlib.util.find_spec(_pkg) is None:
        pytest.skip(f"{_pkg} is not installed (the dev extra has it)", allow_module_level=True)

from test_serve_flags import Served, _free_port, _ids, _metrics, ask_concurrently, sigterm_mid_stream  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([os.path.abspath(SRC), os.environ.get("PYTHONPATH", "")])}
NAME = "tiny-qwen3-served"


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server():
    port = _free_port()  # picked here (bound, then released): uvicorn's --port takes a number
    srv = Served([sys.executable, "-m", "cpattn", "serve", "--model-type", "qwen3", "--dcp", "2",
                  "--max-num-batched-tokens", "8", "--max-num-seqs", "4", "--max-model-len", "256",
                  "--block-size", "4", "--port", str(port), "--served-model-name", NAME], port)
    try:
        yield srv.proc, srv.base
    finally:
        if srv.proc.poll() is None:  # (the SIGTERM test stops it itself)
            code = srv.stop()
            assert code == 0, f"cpattn serve exited {code} on SIGTERM: {srv.proc.stderr.read()}"


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server[1] + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(one_device):
    """greedy(prompt, n): one-device greedy tokens of the model the server builds (same seed, same init), from
    conftest.py's ``one_device`` (a fresh full prefill per token, no engine code)."""
    from cpattn.bench.demo_setup import Spec, load_model

    family, cfg, params = load_model(Spec(model_type="qwen3"))
    return lambda prompt, n: one_device.tokens(family, params, cfg, prompt, n)


P1 = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # 13 tokens: two chunks of the 8-token budget
P2 = [2, 71, 82, 81, 82, 84, 59, 4, 5, 23, 53, 60, 28, 74, 71, 35, 26, 62]



@pytest.mark.slow
def test_completion_tokens_equal_one_device_greedy(client, reference):
    r = client.completions.create(model=NAME, prompt=[P1, P2], max_tokens=6, temperature=0)
    want = [reference(P1, 6), reference(P2, 6)]
    assert [_ids(c) for c in sorted(r.choices, key=lambda c: c.index)] == want
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [" ".join(map(str, w)) for w in want]
    assert {c.finish_reason for c in r.choices} == {"length"}
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (31, 12, 43)
    assert r.model == NAME


@pytest.mark.slow
def test_stop_token_ids_end_the_completion(client, reference):
    want = reference(P1, 6)
    r = client.completions.create(model=NAME, prompt=P1, max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [want[2]]})
    assert _ids(r.choices[0]) == want[:want.index(want[2]) + 1] and r.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_streaming_sends_token_by_token(client, reference):
    chunks = list(client.completions.create(model=NAME, prompt=P2, max_tokens=5, stream=True, temperature=0,
                                            stream_options={"include_usage": True}))
    with_tokens = [c for c in chunks if c.choices]
    assert len(with_tokens) == 5, [c.choices[0].text for c in with_tokens]  # one chunk per decoded token
    assert sum((_ids(c.choices[0]) for c in with_tokens), []) == reference(P2, 5)
    assert "".join(c.choices[0].text for c in with_tokens) == " ".join(map(str, reference(P2, 5)))
    assert with_tokens[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == len(P2)


@pytest.mark.slow
def test_the_same_seed_samples_the_same_tokens(client):
    """temperature 1.0 (OpenAI's default, sent implicitly) with a seed: the same tokens twice, streamed or
    not; another seed, other tokens; and sampled, not the greedy ones."""
    ask = dict(model=NAME, prompt=P1, max_tokens=8, top_p=0.95, extra_body={"top_k": 50})
    a = _ids(client.completions.create(seed=7, **ask).choices[0])
    b = sum((_ids(c.choices[0]) for c in client.completions.create(seed=7, stream=True, **ask) if c.choices), [])
    c = _ids(client.completions.create(seed=8, **ask).choices[0])
    greedy = _ids(client.completions.create(model=NAME, prompt=P1, max_tokens=8, temperature=0).choices[0])
    assert a == b and len(a) == 8 and a != c and greedy not in (a, c)


@pytest.mark.slow
def test_logprobs_in_openai_shape(client, reference, one_device):
    import torch
    from cpattn.bench.demo_setup import Spec, load_model

    r = client.completions.create(model=NAME, prompt=P2, max_tokens=4, temperature=0, logprobs=2)
    choice, want = r.choices[0], reference(P2, 4)
    lp = choice.logprobs
    assert _ids(choice) == want and lp.tokens == [str(want[0])] + [f" {t}" for t in want[1:]]
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(4)]
    family, cfg, params = load_model(Spec(model_type="qwen3"))
    ref = torch.log_softmax(one_device(family, params, cfg, [P2], 4).logits[0].double(), -1)  # [4, V]
    for j, t in enumerate(want):
        top = [(" " if j else "") + str(i) for i in ref[j].topk(2).indices.tolist()]
        assert set(lp.top_logprobs[j]) == {lp.tokens[j], *top}
        assert abs(lp.token_logprobs[j] - float(ref[j, t])) < 1e-4  # float32 model, DCP 2 vs one device
    chunks = [c for c in client.completions.create(model=NAME, prompt=P2, max_tokens=4, temperature=0,
                                                   logprobs=2, stream=True) if c.choices]
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == lp.tokens
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == lp.text_offset


@pytest.mark.slow  # importing the app (fastapi) takes seconds on shared cores
def test_parse_params_reads_the_sampling_fields():
    from cpattn.serve.app import BadRequest, parse_params

    p, _, _ = parse_params({"temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 3, "logprobs": 0})
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.logprobs) == (0.5, 0.9, -1, 3, 0)
    assert parse_params({})[0].temperature == 1.0 and parse_params({"temperature": None})[0].temperature == 1.0
    for body, field in (({"top_k": -3}, "top_k"), ({"seed": "x"}, "seed"), ({"temperature": True}, "temperature"),
                        ({"logprobs": -1}, "logprobs")):
        with pytest.raises(BadRequest) as e:
            parse_params(body)
        assert e.value.param == field and e.value.message.startswith(f"{field}: saw "), e.value.message


@pytest.mark.slow
def test_concurrent_clients_each_get_their_own_tokens(client, server, reference):
    jobs = {"a": (P1, 7, False), "b": (P2[:11], 9, True), "c": (P1[3:], 4, False)}
    steps = _metrics(server[1])["cpattn_steps_total"]
    got, errors = ask_concurrently(client, NAME, jobs, 120)
    assert not errors, errors
    assert got == {k: reference(p, n) for k, (p, n, _) in jobs.items()}
    # one after another they need >= 20 steps (each a prefill step, then n - 1 decodes): fewer means shared steps
    assert _metrics(server[1])["cpattn_steps_total"] - steps < sum(n for _, n, _ in jobs.values())


@pytest.mark.slow
def test_a_stream_closed_by_its_client_is_aborted_and_frees_its_blocks(client, server):
    before = _metrics(server[1])
    stream = client.completions.create(model=NAME, prompt=P1, max_tokens=240, stream=True)  # ~240 steps: seconds
    got = [next(iter(stream)) for _ in range(2)]
    assert all(c.choices for c in got)
    stream.close()  # the client goes away mid-generation
    deadline = time.monotonic() + 30
    while (m := _metrics(server[1]))["cpattn_aborted_requests_total"] < before["cpattn_aborted_requests_total"] + 1:
        assert time.monotonic() < deadline, f"the closed stream's request was not aborted: {m}"
        time.sleep(0.1)
    assert m["cpattn_running_requests"] == 0 and m["cpattn_waiting_requests"] == 0, m
    assert m["cpattn_kv_blocks_used"] == 0, m  # P1's blocks freed (the prefix cache keeps them only as free)
    assert m["cpattn_steps_total"] - before["cpattn_steps_total"] < 200, m  # stopped, not run to max_tokens


@pytest.mark.slow
def test_a_plain_request_whose_client_gives_up_is_aborted_and_frees_its_blocks(server):
    """Not streamed: the client times out after 0.5 s and closes its connection; the server sees the
    disconnect (polled every 0.25 s) and aborts the request instead of running it to max_tokens."""
    import openai

    before = _metrics(server[1])
    impatient = openai.OpenAI(base_url=server[1] + "/v1", api_key="x", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=NAME, prompt=P1, max_tokens=240)  # ~240 steps: seconds
    deadline = time.monotonic() + 30
    while (m := _metrics(server[1]))["cpattn_aborted_requests_total"] < before["cpattn_aborted_requests_total"] + 1:
        assert time.monotonic() < deadline, f"the abandoned request was not aborted: {m}"
        time.sleep(0.1)
    assert m["cpattn_running_requests"] == 0 and m["cpattn_kv_blocks_used"] == 0, m
    assert m["cpattn_steps_total"] - before["cpattn_steps_total"] < 200, m  # stopped, not run to max_tokens


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, words", [
    ({"prompt": [1, 2, 512]}, "outside the vocabulary"),
    ({"prompt": [1, 2, 3], "max_tokens": 300}, "max_model_len is 256"),
    ({"prompt": "hello"}, "no tokenizer"),
    ({"prompt": [1, 2, 3], "temperature": -0.5}, "temperature: saw -0.5; expected a finite number >= 0"),
    ({"prompt": [1, 2, 3], "top_p": 0}, "top_p: saw 0; expected 0 < top_p <= 1"),
    ({"prompt": [1, 2, 3], "logprobs": 21}, "logprobs: saw 21; expected at most 20"),
], ids=["vocab", "max_tokens", "text", "temperature", "top_p", "logprobs"])
def test_bad_requests_are_400_in_openai_shape(client, server, kwargs, words):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, **{"max_tokens": 3, **kwargs})
    assert e.value.status_code == 400 and words in e.value.body["message"], e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    assert _get(server[1] + "/health") == (200, {"status": "ok"})  # still serving


@pytest.mark.slow
def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [NAME]


@pytest.mark.slow
def test_listens_only_on_loopback_by_default(server):
    from cpattn.comm.listeners import listening

    proc, base = server
    port = int(base.rsplit(":", 1)[1])
    mine = listening([proc.pid])
    assert any(x.port == port for x in mine), mine
    assert all(x.loopback for x in mine), f"cpattn serve listens beyond loopback: {mine}"


# -- the command line (no server started) ------------------------------------------------------
def _cli(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], "--port"), (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "64"], "--max-num-batched-tokens"),
    (["--host", "10.255.255.254"], "--host"),
])
def test_bad_flags_one_line_exit_2_before_torch(argv, words):
    r = _cli(f"import sys\nfrom cpattn.cli import main\ntry:\n    code = main(['serve', *{argv!r}])\n"
             "except SystemExit as e:\n    code = e.code\nprint('torch' in sys.modules)\nsys.exit(code)")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r
    assert r.stdout.strip() == "False", "cpattn serve imported torch before refusing a bad flag"


def test_missing_uvicorn_is_one_line_exit_2():
    r = _cli("import sys\nsys.modules['uvicorn'] = None\nfrom cpattn.cli import main\nsys.exit(main(['serve']))")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "uvicorn" in r.stderr and "pip install" in r.stderr, r


@pytest.mark.slow
@pytest.mark.parametrize("backend", [[], ["--dcp", "2", "--distributed-executor-backend", "mp"]], ids=["uni", "mp"])
def test_a_family_the_step_loop_cannot_run_is_one_line_exit_2(backend):
    """Refused once the engine builds: in this process, or on every gloo rank (the command says it once)."""
    argv = ["serve", "--model-type", "deepseek_v4", *backend, "--port", str(_free_port())]
    r = _cli(f"import sys\nfrom cpattn.cli import main\nsys.exit(main({argv!r}))")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--model-type" in r.stderr, r


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight_then_exits_0(server, client, reference):
    """Runs last (file order): it stops the module's server."""
    proc, _ = server
    got = sigterm_mid_stream(client, NAME, P2, 40, proc)
    assert got == reference(P2, 40)  # the whole answer, not cut off
    assert proc.wait(60) == 0, proc.stderr.read()
