"""One-server P/D (``kv_both``) on real ranks: ``--pcp P --dcp D --distributed-executor-backend mp`` (or torchrun).

- The protocol in process (the simulated mesh, the same code the gloo ranks run): rank 0's
  :class:`~cpattn.serve.engine_loop.EngineLoop` over a :class:`~cpattn.serve.pd_ranks.RankPD` with a
  :class:`~cpattn.serve.ranks.Mirror`, ranks 1 (prefill) and 2 (decode) :func:`~cpattn.serve.ranks.follow`;
  requests arriving while it runs, one aborted mid-decode: tokens equal one-device greedy, both roles'
  blocks freed.
- The real server, PCP 2 -> DCP 1 on three gloo rank processes, with the real ``openai`` client:
  greedy tokens equal one device's (streamed too), a seeded sampled request (with logprobs) equals the
  thread P/D engine's (``PDEngine``, the engine the ``uni`` server runs), a closed stream aborted with
  its blocks freed on both roles (``/metrics`` per role), loopback-only listeners, SIGTERM exits 0.
- The same under torchrun (``external_launcher``, three workers): greedy tokens equal one device's.
- Refusals before any rank starts: an in-process pool on rank processes, a torchrun world other than P + D.
"""

from __future__ import annotations

import sys
import time

import pytest
from serve_helpers import ids as _ids
from serve_helpers import run_jobs
from test_serve_flags import Served, _free_port, _greedy, _metrics, embedded, needs_serving  # noqa: F401

P1 = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # 13 tokens: two chunks of the 8-token budget
P2 = [2, 71, 82, 81, 82, 84, 59, 4, 5, 23, 53, 60, 28, 74, 71, 35, 26, 62]
NAME = "cpattn-qwen3"
KV = '{"kv_connector": "CpattnPoolConnector", "kv_role": "kv_both"}'


def _sched():
    from cpattn.config import SchedulerConfig

    return SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=256)


def _pd_loop(g, family, params, cfg, jobs):
    """Rank 0: an EngineLoop with a Mirror over RankPD serving ``jobs`` (prompt, max_tokens, abort after k
    tokens or None); the others follow. Returns rank 0's tokens per job (None: aborted) and its stats;
    the others their role's blocks in use."""
    from cpattn.serve.engine_loop import EngineLoop
    from cpattn.serve.pd_ranks import RankPD
    from cpattn.serve.ranks import Mirror, follow

    engine = RankPD(g, family, params, cfg, pcp_size=2, dcp_size=1, block_size=4, scheduler=_sched())
    if g.rank > 0:
        follow(engine, g)
        engine.close()
        return engine.engine.stats.blocks_used
    loop = EngineLoop(engine, mirror=Mirror(g), idle_wait_s=0.05)

    try:
        got = run_jobs(loop, jobs)
    finally:
        engine.close()
    return got, loop.stats


@pytest.mark.slow
def test_rank_pd_under_the_mirror_on_the_simulated_mesh(embedded):
    import cpattn

    family, cfg, params = embedded
    jobs = [(P1, 6, None), (P2, 200, 3), (P1[4:], 5, None)]
    (got, stats), b1, b2 = cpattn.simulate(3, _pd_loop, family, params, cfg, jobs)
    assert got == [_greedy(embedded, P1, 6), None, _greedy(embedded, P1[4:], 5)]
    assert stats.decode.steps < 150, stats  # the decode role stopped the aborted request (200 tokens otherwise)
    assert stats.handed_off == 3 and stats.prefill.blocks_used == 0 and stats.decode.blocks_used == 0, stats
    assert (b1, b2) == (0, 0)  # the abort reached the decode role (rank 2) and the other prefill rank


def _through_pool(g, family, params, cfg, spec, prompt):
    from cpattn.engine.connector import PoolConnector
    from cpattn.engine.pooling import PoolSpec
    from cpattn.engine.sampling import SamplingParams
    from cpattn.serve.pd_ranks import RankPD

    e = RankPD(g, family, params, cfg, pcp_size=2, dcp_size=1, block_size=4, scheduler=_sched(),
               kv_connector=PoolConnector(PoolSpec(spec)))
    try:
        e.add_request(prompt, SamplingParams(max_tokens=5), request_id="r")
        outs = []
        while e.has_unfinished():
            outs += e.step()
        return [list(o.token_ids) for o in outs if o.finished], e.stats.decode.pool_hit_tokens
    finally:
        e.close()


@pytest.mark.slow
def test_rank_pd_through_an_lmdb_pool(embedded, tmp_path):
    """``--kv-pool lmdb:DIR``: the blocks go through the pool, not rank to rank; rank 0 reports the tokens."""
    import cpattn

    family, cfg, params = embedded
    got = cpattn.simulate(3, _through_pool, family, params, cfg, f"lmdb:{tmp_path / 'pool'}", P2)
    assert got[0] == ([_greedy(embedded, P2, 5)], 16) and got[1][0] == got[2][0] == []  # 16 of 18 from the pool


# ----------------------------------------------------------------------------- the real server: PCP 2 -> DCP 1
@pytest.fixture(scope="module")
def pd_server():
    port = _free_port()
    srv = Served([sys.executable, "-m", "cpattn", "serve", "--model-type", "qwen3", "--pcp", "2", "--dcp", "1",
                  "--kv-transfer-config", KV, "--distributed-executor-backend", "mp", "--block-size", "4",
                  "--max-num-batched-tokens", "8", "--max-num-seqs", "4", "--max-model-len", "256",
                  "--port", str(port)], port)
    try:
        yield srv
    finally:
        srv.stop()


def _thread_pd(embedded, prompt, params):
    """The thread P/D engine's final output (PCP 2 -> DCP 1, in-process pool): the ``uni`` server's engine."""
    from cpattn.engine.outputs import drain
    from cpattn.engine.pd_engine import PDEngine

    family, cfg, p = embedded
    engine = PDEngine(family, p, cfg, pcp_size=2, dcp_size=1, block_size=4, scheduler=_sched())
    try:
        return drain(engine, [prompt], params)[0]
    finally:
        engine.close()


@pytest.mark.slow
@needs_serving
def test_pd_mp_server_greedy_seeded_and_logprobs(pd_server, embedded):
    from cpattn.engine.llm import SamplingParams

    client = pd_server.client()
    line = pd_server.proc.stderr.readline()
    while "/v1 ;" not in line:
        assert line, "no start line"
        line = pd_server.proc.stderr.readline()
    assert "P/D: prefill PCP 2 -> decode DCP 1 via blocks rank to rank" in line and "3 gloo ranks (mp)" in line, line
    r = client.completions.create(model=NAME, prompt=[P1, P2], max_tokens=6, temperature=0)
    assert [_ids(c) for c in sorted(r.choices, key=lambda c: c.index)] == \
        [_greedy(embedded, P1, 6), _greedy(embedded, P2, 6)]
    chunks = [_ids(c.choices[0]) for c in client.completions.create(model=NAME, prompt=P2[::-1], max_tokens=5,
                                                                     stream=True, temperature=0) if c.choices]
    assert sum(chunks, []) == _greedy(embedded, P2[::-1], 5) and len(chunks) == 5
    ask = dict(model=NAME, prompt=P1, max_tokens=8, top_p=0.95, seed=7, logprobs=2, extra_body={"top_k": 50})
    choice = client.completions.create(**ask).choices[0]
    want = _thread_pd(embedded, P1, SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, top_k=50, seed=7,
                                                   logprobs=2))
    assert _ids(choice) == list(want.token_ids) and _ids(choice) != _greedy(embedded, P1, 8)
    lp = choice.logprobs.token_logprobs
    assert lp == pytest.approx([d[t] for d, t in zip(want.logprobs, want.token_ids)], abs=1e-5), (lp, want)
    assert [len(d) for d in choice.logprobs.top_logprobs] == [len(d) for d in want.logprobs]
    m = _metrics(pd_server.base)
    assert m["cpattn_handed_off_requests_total"] == 4, m
    assert m['cpattn_pcp_steps_total{role="prefill"}'] > 0 and m['cpattn_steps_total{role="decode"}'] > 0, m


@pytest.mark.slow
@needs_serving
def test_pd_mp_server_closed_stream_frees_both_roles(pd_server, embedded):
    client = pd_server.client()
    before = _metrics(pd_server.base)
    stream = client.completions.create(model=NAME, prompt=P1, max_tokens=240, stream=True)
    assert all(next(iter(stream)).choices for _ in range(3))  # the decode role holds it now
    stream.close()
    deadline = time.monotonic() + 60
    while (m := _metrics(pd_server.base))["cpattn_aborted_requests_total"] < before["cpattn_aborted_requests_total"] + 1 \
            or m['cpattn_kv_blocks_used{role="decode"}'] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    steps = m['cpattn_steps_total{role="decode"}'] - before['cpattn_steps_total{role="decode"}']
    assert steps < 200, m  # the decode role stopped it (240 tokens otherwise)
    for role in ("prefill", "decode"):
        assert m[f'cpattn_kv_blocks_used{{role="{role}"}}'] == 0, m
        assert m[f'cpattn_running_requests{{role="{role}"}}'] == 0, m
    r = client.completions.create(model=NAME, prompt=P2, max_tokens=3, temperature=0)  # the ranks still agree
    assert _ids(r.choices[0]) == _greedy(embedded, P2, 3)


@pytest.mark.slow
@needs_serving
def test_pd_mp_server_listens_on_loopback_only_and_stops(pd_server):
    """Runs last (file order): it stops the module's server."""
    from cpattn.comm.listeners import listening, process_tree

    tree = process_tree(pd_server.proc.pid)
    mine = listening(tree)
    port = int(pd_server.base.rsplit(":", 1)[1])
    assert len(tree) >= 4 and any(x.port == port for x in mine), (tree, mine)  # the command, forkserver, 3 ranks
    assert all(x.loopback for x in mine), f"cpattn serve's ranks listen beyond loopback: {mine}"
    assert pd_server.stop() == 0, pd_server.proc.stderr.read()


@pytest.mark.slow
@needs_serving
def test_pd_under_torchrun(embedded):
    """``torchrun --nproc-per-node 3 -m cpattn serve --pcp 2 --dcp 1 --kv-transfer-config kv_both``: the ranks
    torchrun started run the same RankPD as ``mp``'s; greedy tokens (the real ``openai`` client) equal one
    device's, every listener is on loopback, and SIGTERM to torchrun ends every worker."""
    import pathlib
    import shutil

    from cpattn.comm.listeners import listening, process_tree
    from test_serve_ranks import _alive, _start_line

    torchrun = shutil.which("torchrun") or str(pathlib.Path(sys.executable).with_name("torchrun"))
    port, master = _free_port(), _free_port()
    srv = Served([torchrun, "--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port", str(master),
                  "-m", "cpattn", "serve", "--model-type", "qwen3", "--pcp", "2", "--dcp", "1",
                  "--kv-transfer-config", KV, "--block-size", "4", "--max-num-batched-tokens", "8",
                  "--max-num-seqs", "4", "--max-model-len", "256", "--port", str(port)], port)
    tree = []
    try:
        line = _start_line(srv)
        assert "P/D: prefill PCP 2 -> decode DCP 1 via blocks rank to rank" in line, line
        assert "3 gloo ranks (external_launcher)" in line, line
        client = srv.client()
        r = client.completions.create(model=NAME, prompt=[P1, P2], max_tokens=6, temperature=0)
        assert [_ids(c) for c in sorted(r.choices, key=lambda c: c.index)] == \
            [_greedy(embedded, P1, 6), _greedy(embedded, P2, 6)]
        chunks = [_ids(c.choices[0]) for c in client.completions.create(model=NAME, prompt=P2[::-1], max_tokens=5,
                                                                         stream=True, temperature=0) if c.choices]
        assert sum(chunks, []) == _greedy(embedded, P2[::-1], 5)
        assert _metrics(srv.base)["cpattn_handed_off_requests_total"] == 3
        tree = process_tree(srv.proc.pid)
        mine = [x for x in listening(tree[1:]) if x.port != master]  # torchrun's rendezvous store is its own
        assert any(x.port == port for x in mine) and all(x.loopback for x in mine), mine
    finally:
        tree = tree or process_tree(srv.proc.pid)
        srv.stop()  # torchrun's own exit status after a signal is not 0 (it raises SignalException)
        deadline = time.monotonic() + 60
        while any(map(_alive, tree[1:])) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in tree[1:] if _alive(p)], "a torchrun worker outlived it"


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, argv, said", [
    ({}, ["--kv-pool", "memory", "--distributed-executor-backend", "mp"], ["argument --kv-pool", "drop --kv-pool"]),
    ({**TORCHRUN, "WORLD_SIZE": "3"}, ["--kv-pool", "memory"],
     ["argument --kv-pool", "memory with --distributed-executor-backend external_launcher", "drop --kv-pool"]),
    (TORCHRUN, [], ["argument --distributed-executor-backend", "WORLD_SIZE=2 with --pcp=2 --dcp=1 and kv_role kv_both",
                    "torchrun --nproc-per-node 3, or --pcp + --dcp = 2"]),
], ids=["memory-pool", "memory-pool-torchrun", "torchrun-world-size"])
def test_pd_refusals_on_real_ranks(env, argv, said, capsys, monkeypatch):
    from test_serve_flags import _refusal

    for k in TORCHRUN:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    err = _refusal(["--pcp", "2", "--dcp", "1", "--kv-transfer-config", KV, *argv, "--port", str(_free_port())],
                   capsys)
    for piece in said:
        assert piece in err, (piece, err)
