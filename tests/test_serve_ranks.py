"""``cpattn serve`` on real ranks: rank 0 serves HTTP and mirrors each turn's engine calls to the others.

- The mirror protocol in process (the simulated mesh, the same code the gloo ranks run): rank 0's
  :class:`~cpattn.serve.engine_loop.EngineLoop` over a world engine with a
  :class:`~cpattn.serve.ranks.Mirror`, rank 1 :func:`~cpattn.serve.ranks.follow`; requests submitted
  while it runs, one aborted: every token equals one-device greedy, both ranks run the same steps.
- ``--distributed-executor-backend mp --dcp 2``: the real server (two gloo rank processes) talked to by
  the real ``openai`` client: greedy tokens equal one device's, seeded sampled tokens equal the
  thread-mesh engine's (``LLMEngine(dcp_size=2)`` in this process, the engine the default server
  runs), concurrent clients, a closed stream aborted on every rank (its blocks freed), loopback-only
  listeners in the whole process tree, SIGTERM mid-stream drains and exits 0.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest
from serve_helpers import ids as _ids
from serve_helpers import run_jobs
from test_serve_flags import (Served, _free_port, _greedy, _metrics, ask_concurrently, embedded,  # noqa: F401
                              needs_serving, sigterm_mid_stream)

P1 = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # 13 tokens: two chunks of the 8-token budget
P2 = [2, 71, 82, 81, 82, 84, 59, 4, 5, 23, 53, 60, 28, 74, 71, 35, 26, 62]
NAME = "cpattn-qwen3"


def _mirrored(g, family, params, cfg, jobs):
    """Rank 0: an EngineLoop with a Mirror serving ``jobs`` (prompt, max_tokens, abort after k tokens or
    None); rank 1: follow. Returns rank 0's final tokens per job (None: aborted) and each rank's steps."""
    from cpattn.config import SchedulerConfig
    from cpattn.engine.llm import LLMEngine
    from cpattn.serve.engine_loop import EngineLoop
    from cpattn.serve.ranks import Mirror, follow

    engine = LLMEngine(family, params, cfg, world=g, dcp_size=2, block_size=4, num_blocks=64, seed=0,
                       scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=256))
    if g.rank == 1:
        return follow(engine, g), engine.stats.blocks_used
    mirror = Mirror(g)
    loop = EngineLoop(engine, mirror=mirror, idle_wait_s=0.05)

    got = run_jobs(loop, jobs)
    return got, engine.stats.steps, engine.stats.blocks_used, mirror.turns


def test_a_follower_makes_rank_0s_calls_and_steps(embedded):
    import cpattn

    family, cfg, params = embedded
    jobs = [(P1, 6, None), (P2, 40, 2), (P1[4:], 5, None)]
    r0, r1 = cpattn.simulate(2, _mirrored, family, params, cfg, jobs)
    got, steps, blocks, turns = r0
    assert got[0] == _greedy(embedded, P1, 6) and got[2] == _greedy(embedded, P1[4:], 5)
    assert got[1] is None  # aborted after 2 tokens, on both ranks: no blocks left on either
    assert r1 == (steps, 0) and blocks == 0 and turns > steps  # same steps; idle turns sent too


# ----------------------------------------------------------------------------- the real server on gloo ranks
@pytest.fixture(scope="module")
def mp_server():
    port = _free_port()
    srv = Served([sys.executable, "-m", "cpattn", "serve", "--model-type", "qwen3", "--dcp", "2",
                  "--distributed-executor-backend", "mp", "--block-size", "4", "--max-num-batched-tokens", "8",
                  "--max-num-seqs", "4", "--max-model-len", "256", "--port", str(port)], port)
    try:
        yield srv
    finally:
        srv.stop()


def _thread_mesh_tokens(embedded, prompt, params) -> list[int]:
    """The tokens of the engine the default (uni) server runs: DCP 2 threads in this process."""
    from cpattn.config import SchedulerConfig
    from cpattn.engine.llm import LLMEngine

    family, cfg, p = embedded
    engine = LLMEngine(family, p, cfg, dcp_size=2, block_size=4,
                       scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=256))
    return list(engine.generate([prompt], params)[0].token_ids)


@pytest.mark.slow
@needs_serving
def test_mp_server_greedy_and_seeded_tokens(mp_server, embedded):
    from cpattn.engine.llm import SamplingParams

    client = mp_server.client()
    assert "2 gloo ranks (mp)" in _start_line(mp_server)
    r = client.completions.create(model=NAME, prompt=[P1, P2], max_tokens=6, temperature=0)
    assert [_ids(c) for c in sorted(r.choices, key=lambda c: c.index)] == \
        [_greedy(embedded, P1, 6), _greedy(embedded, P2, 6)]
    chunks = [_ids(c.choices[0]) for c in client.completions.create(model=NAME, prompt=P2, max_tokens=5,
                                                                     stream=True, temperature=0) if c.choices]
    assert sum(chunks, []) == _greedy(embedded, P2, 5) and len(chunks) == 5
    ask = dict(model=NAME, prompt=P1, max_tokens=8, top_p=0.95, seed=7, extra_body={"top_k": 50})
    sampled = _ids(client.completions.create(**ask).choices[0])
    want = _thread_mesh_tokens(embedded, P1, SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, top_k=50,
                                                            seed=7))
    assert sampled == want and sampled != _greedy(embedded, P1, 8)


@pytest.mark.slow
@needs_serving
def test_mp_server_concurrent_clients_and_a_closed_stream(mp_server, embedded):
    client = mp_server.client()
    jobs = {"a": (P1, 7, False), "b": (P2[:11], 9, True), "c": (P1[3:], 4, False)}
    got, errors = ask_concurrently(client, NAME, jobs, 180)
    assert not errors, errors
    assert got == {k: _greedy(embedded, p, n) for k, (p, n, _) in jobs.items()}
    before = _metrics(mp_server.base)
    stream = client.completions.create(model=NAME, prompt=P1, max_tokens=240, stream=True)
    assert all(next(iter(stream)).choices for _ in range(2))
    stream.close()  # mid-generation: rank 0 aborts and mirrors the abort, so rank 1 stops stepping it too
    deadline = time.monotonic() + 60
    aborted = before["cpattn_aborted_requests_total"] + 1
    while (m := _metrics(mp_server.base))["cpattn_aborted_requests_total"] < aborted:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["cpattn_running_requests"] == 0 and m["cpattn_kv_blocks_used"] == 0, m
    r = client.completions.create(model=NAME, prompt=P2, max_tokens=3, temperature=0)  # the ranks still agree
    assert _ids(r.choices[0]) == _greedy(embedded, P2, 3)


@pytest.mark.slow
@needs_serving
def test_mp_server_listens_on_loopback_only(mp_server):
    from cpattn.comm.listeners import listening, process_tree

    tree = process_tree(mp_server.proc.pid)  # the command, its forkserver and the ranks
    mine = listening(tree)
    port = int(mp_server.base.rsplit(":", 1)[1])
    assert len(tree) >= 3 and any(x.port == port for x in mine), (tree, mine)
    assert all(x.loopback for x in mine), f"cpattn serve's ranks listen beyond loopback: {mine}"


@pytest.mark.slow
@needs_serving
def test_mp_server_sigterm_drains_then_exits_0(mp_server, embedded):
    """Runs last (file order): it stops the module's server."""
    got = sigterm_mid_stream(mp_server.client(), NAME, P2, 40, mp_server.proc)
    assert got == _greedy(embedded, P2, 40)
    assert mp_server.proc.wait(60) == 0, mp_server.proc.stderr.read()
    assert not mp_server.proc.stdout.read()  # stdout stays empty (the ranks print to stderr)


def _start_line(srv) -> str:
    """The server's start line: read from its stderr up to the first line naming its URL."""
    if not hasattr(srv, "_start"):
        lines = []
        while not lines or "/v1 ;" not in lines[-1]:
            lines.append(srv.proc.stderr.readline())
            assert lines[-1], lines
        srv._start = lines[-1]
    return srv._start


@pytest.mark.slow
@needs_serving
def test_torchrun_rank_0_serves_and_the_other_follows(embedded):
    """``torchrun --nproc-per-node 2 -m cpattn serve --dcp 2``: external_launcher is the default under
    torchrun; rank 0 serves (its start line says so), the tokens equal one device's, and SIGTERM to
    torchrun (which passes it on to its workers) ends every process."""
    import shutil

    torchrun = shutil.which("torchrun") or str(pathlib.Path(sys.executable).with_name("torchrun"))
    port, master = _free_port(), _free_port()
    srv = Served([torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(master),
                  "-m", "cpattn", "serve", "--model-type", "qwen3", "--dcp", "2", "--block-size", "4",
                  "--max-num-batched-tokens", "8", "--max-model-len", "256", "--port", str(port)], port)
    try:
        assert "2 gloo ranks (external_launcher)" in _start_line(srv)
        client = srv.client()
        r = client.completions.create(model=NAME, prompt=[P1, P2], max_tokens=5, temperature=0)
        assert [_ids(c) for c in sorted(r.choices, key=lambda c: c.index)] == \
            [_greedy(embedded, P1, 5), _greedy(embedded, P2, 5)]
        from cpattn.comm.listeners import listening, process_tree

        workers = process_tree(srv.proc.pid)[1:]  # torchrun's own rendezvous store is torchrun's, not ours
        mine = [x for x in listening(workers) if x.port != master]
        assert any(x.port == port for x in mine) and all(x.loopback for x in mine), mine
    finally:
        from cpattn.comm.listeners import process_tree

        tree = process_tree(srv.proc.pid)
        srv.stop()  # torchrun's own exit status after a signal is not 0 (it raises SignalException)
        deadline = time.monotonic() + 60
        while any(map(_alive, tree[1:])) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in tree[1:] if _alive(p)], "a torchrun worker outlived it"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.slow
@needs_serving
def test_mp_server_exits_1_naming_a_rank_that_died():
    """SIGKILL to rank 1: the next request is a 503 (never a hang), and the command exits 1 with one
    line naming rank 1 (spawn's watch ends rank 0)."""
    import signal

    import openai
    from cpattn.comm.listeners import listening, process_tree

    port = _free_port()
    srv = Served([sys.executable, "-m", "cpattn", "serve", "--model-type", "qwen3", "--dcp", "2", "--block-size", "4",
                  "--distributed-executor-backend", "mp", "--port", str(port)], port)
    try:
        tree = process_tree(srv.proc.pid)
        rank0 = {x.pid for x in listening(tree) if x.port == port}
        forkserver_children = [p for p in tree[1:] if p not in rank0 and _parent(p) not in (srv.proc.pid, None)]
        assert len(rank0) == 1 and len(forkserver_children) == 1, (tree, rank0, forkserver_children)
        os.kill(forkserver_children[0], signal.SIGKILL)
        time.sleep(1)
        with pytest.raises(openai.APIStatusError) as e:
            srv.client().completions.create(model=NAME, prompt=P1, max_tokens=3)
        assert e.value.status_code == 503, e.value
        assert srv.proc.wait(60) == 1
        err = srv.proc.stderr.read()
        assert "cpattn serve: the ranks failed: " in err and "rank 1 was killed by SIGKILL" in err, err
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


# ----------------------------------------------------------------------------- the backend flag (no rank started)
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, argv, said", [
    (TORCHRUN, ["--dcp", "3"], ["argument --distributed-executor-backend", "WORLD_SIZE=2 with --dcp=3",
                                "--nproc-per-node 3"]),
    (TORCHRUN, ["--dcp", "2", "--distributed-executor-backend", "mp"], ["mp under torchrun", "drop the flag"]),
    ({}, ["--distributed-executor-backend", "ray"], ["--distributed-executor-backend", "'ray'"]),
], ids=["world-size", "mp-under-torchrun", "ray"])
def test_backend_refusals_exit_2_before_any_rank(env, argv, said, capsys, monkeypatch):
    from test_serve_flags import _refusal

    for k in TORCHRUN:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    err = _refusal([*argv, "--port", str(_free_port())], capsys)
    for piece in said:
        assert piece in err, (piece, err)


def test_backend_defaults(monkeypatch):
    from cpattn.serve import cli as serve_cli

    for k in TORCHRUN:
        monkeypatch.delenv(k, raising=False)
    a = serve_cli.parser().parse_args(["--dcp", "2"])
    serve_cli.check_args(a)
    assert a.distributed_executor_backend == "uni"
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    a = serve_cli.parser().parse_args(["--dcp", "2"])
    serve_cli.check_args(a)
    assert a.distributed_executor_backend == "external_launcher"
    assert "2 gloo ranks (external_launcher)" in serve_cli.describe(a, None)
