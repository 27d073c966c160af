"""Graph-captured decode programs: capture sizes, padding, eager fallback, backends, DCP in graphs.

Oracle: a float64 dense causal forward of the demo program over each whole
sequence, written plainly here (rope, rmsnorm) on top of tests/ref/dense.py.
Captured results are also compared with the eager step on a copy of the
same state (equal within 1e-6 in fp32).
"""

from __future__ import annotations

import pytest
import torch

import ref as oracle
from cpattn.comm import simulate
from cpattn.comm.launch import spawn
from cpattn.comm.sim import SimMesh
from cpattn.graphs import (
    BackendUnavailable, CompileBackend, DecodeRunner, EagerBackend, Field, StaticStepError, backends,
    capture_sizes, check_static, get_backend, pick_size, register_backend,
)
from cpattn.graphs import demo_program as dp
from devices import needs_cuda

TOL = 1e-6  # captured vs eager, fp32


# ----------------------------------------------------------------------------- oracle
def _rope64(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-(torch.arange(d // 2, dtype=torch.float64) * 2 / d))
    ang = pos.double()[:, None] * inv[None]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def dense_forward(cfg, params, xs):
    """float64 forward of the demo program over one whole sequence xs [S, hidden] -> [S, hidden]."""
    x = xs.double()
    s = x.shape[0]
    pos = torch.arange(s)
    req = torch.zeros(s, dtype=torch.long)
    for p in params["layers"]:
        p = {k: v.double() for k, v in p.items()}
        h = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps) * p["norm"]
        q = _rope64((h @ p["wq"]).view(s, cfg.num_heads, cfg.head_dim), pos, cfg.rope_theta)
        k = _rope64((h @ p["wk"]).view(s, cfg.num_kv_heads, cfg.head_dim), pos, cfg.rope_theta)
        v = (h @ p["wv"]).view(s, cfg.num_kv_heads, cfg.head_dim)
        a, _ = oracle.attention(q, k, v, req, req, pos, pos)
        x = x + a.flatten(1) @ p["wo"]
    return x


class Session:
    """Requests with distinct blocks, their history of inputs, and batch builders."""

    def __init__(self, cfg, num_reqs, prompt_lens, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        perm = torch.randperm(cfg.num_blocks, generator=g)[: num_reqs * cfg.max_blocks]
        self.block_table = perm.view(num_reqs, cfg.max_blocks)
        self.hist = [torch.randn(n, cfg.hidden, generator=g) for n in prompt_lens]
        self.g = g

    def prefill(self, reqs):
        x = torch.cat([self.hist[b] for b in reqs])
        lens = torch.tensor([len(self.hist[b]) for b in reqs])
        return {"x": x, "seq_lens": lens, "block_table": self.block_table[reqs]}, lens.tolist()

    def decode(self, reqs, q_len=1):
        new = [torch.randn(q_len, self.cfg.hidden, generator=self.g) for _ in reqs]
        for b, x in zip(reqs, new):
            self.hist[b] = torch.cat([self.hist[b], x])
        lens = torch.tensor([len(self.hist[b]) for b in reqs])
        batch = {"x": torch.cat(new), "seq_lens": lens, "block_table": self.block_table[reqs]}
        return batch, [q_len] * len(reqs)

    def expected(self, params, reqs, q_len):
        """Oracle rows for the last q_len tokens of each request, packed [B*q_len, hidden]."""
        return torch.cat([dense_forward(self.cfg, params, self.hist[b])[-q_len:] for b in reqs])


def _clone_state(state):
    return {"params": state["params"], "kv": [(k.clone(), v.clone()) for k, v in state["kv"]]}


def _eager_step(cfg, group, state, batch, query_lens):
    cu = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32).to(batch["x"].device)
    return dp.decode_step(state, {**batch, "cu_seqlens_q": cu}, cfg=cfg, group=group)


def _one_rank():
    return SimMesh(1).groups()[0]  # size 1: collectives are clones, so the step is traceable


# ----------------------------------------------------------------------------- buckets
def test_capture_sizes_default_and_speculative():
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    for k in (1, 2, 3):
        sizes = capture_sizes(48, num_speculative_tokens=k)
        assert all(s % (k + 1) == 0 for s in sizes) and sizes[-1] == 48 // (k + 1) * (k + 1)
    assert pick_size([2, 4, 8], 5) == 8 and pick_size([2, 4, 8], 8) == 8 and pick_size([2, 4, 8], 9) is None
    with pytest.raises(ValueError, match="multiples of 1 \\+ num_speculative_tokens = 2"):
        DecodeRunner(lambda s, b: b["x"], {}, {"x": Field("token")}, capture_sizes=[2, 3], num_speculative_tokens=1)


# ----------------------------------------------------------------------------- runner mechanics
def test_padding_rows_and_stale_rows_are_reset():
    seen = []

    def step(state, batch):
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch["x"] * 2, batch["seq"] + 0  # one per-token and one per-request output

    fields = {"x": Field("token", (2,), pad=0.0), "slot": Field("token", (), torch.int64, pad=-1),
              "seq": Field("request", (), torch.int64, pad=0)}
    runner = DecodeRunner(step, {}, fields, num_speculative_tokens=1, capture_sizes=[2, 8], backend="eager")
    runner.capture()
    assert seen[-1]["slot"].eq(-1).all() and seen[-1]["cu_seqlens_q"].eq(0).all()  # capture: all padding
    big = {"x": torch.ones(6, 2), "slot": torch.arange(6), "seq": torch.tensor([5, 6, 7])}
    out_x, out_seq = runner(big, query_lens=[2, 2, 2])
    assert runner.stats.last == "graph:8" and out_x.shape == (6, 2) and out_seq.tolist() == [5, 6, 7]
    b = seen[-1]
    assert b["slot"].tolist() == [0, 1, 2, 3, 4, 5, -1, -1] and b["seq"].tolist() == [5, 6, 7, 0]
    assert b["cu_seqlens_q"].tolist() == [0, 2, 4, 6, 6] and b["x"][6:].eq(0).all()
    runner({"x": torch.ones(2, 2), "slot": torch.tensor([9, 10]), "seq": torch.tensor([3])}, query_lens=[2])
    assert runner.stats.last == "graph:2" and seen[-1]["cu_seqlens_q"].tolist() == [0, 2]
    # 2 requests in size 8 after the 3-request step: the stale rows 4, 5 are reset to pad values
    out_x, out_seq = runner({"x": torch.full((4, 2), 3.0), "slot": torch.arange(4) + 20, "seq": torch.tensor([1, 2])},
                            query_lens=[2, 2])
    b = seen[-1]
    assert b["slot"].tolist() == [20, 21, 22, 23, -1, -1, -1, -1] and b["seq"].tolist() == [1, 2, 0, 0]
    assert b["cu_seqlens_q"].tolist() == [0, 2, 4, 4, 4] and b["x"][4:].eq(0).all()
    assert out_x.eq(6.0).all() and out_x.shape == (4, 2) and out_seq.tolist() == [1, 2]


def test_paths_and_counters():
    def step(state, batch):
        return batch["x"] + 1

    runner = DecodeRunner(step, {}, {"x": Field("token", (3,))}, capture_sizes=[1, 2, 4], backend="eager")
    x = lambda n: {"x": torch.zeros(n, 3)}  # noqa: E731
    runner(x(2), [1, 1])
    assert runner.stats.last == "eager:not_captured"
    runner.capture()
    for n in (1, 2, 3, 4):
        assert runner(x(n), [1] * n).shape == (n, 3)
    assert runner.stats.sizes == {1: 1, 2: 1, 4: 2} and runner.stats.padded_tokens == 1
    runner(x(5), [5])
    runner(x(3), [1, 2])
    runner(x(5), [1] * 5)
    runner(x(0), [])
    assert runner.stats.reasons == {"not_captured": 1, "prefill": 1, "mixed": 1, "oversized": 1, "empty": 1}
    assert runner.stats.graph == 4 and runner.stats.eager == 5
    with pytest.raises(ValueError, match="batch\\['x'\\] has shape \\(2, 3\\)"):
        runner(x(2), [1, 1, 1])
    with pytest.raises(ValueError, match="missing \\[\\]"):
        runner({**x(1), "y": torch.zeros(1)}, [1])
    with pytest.raises(ValueError, match="one row per query token"):
        DecodeRunner(lambda s, b: b["x"].sum(), {}, {"x": Field("token")}, capture_sizes=[2], backend="eager").capture()


# ----------------------------------------------------------------------------- the demo program, one rank
def _check_decode(cfg, backend, sizes, q_len, batch_sizes, merge="ag_rs", seed=0, device="cpu"):
    """Prefill (eager), then decode steps of every batch size: captured == eager, both == oracle."""
    cfg = dp.ProgramConfig(**{**cfg.__dict__, "merge": merge})
    params = dp.init_params(cfg, seed=seed)
    group = _one_rank()
    state = dp.init_state(cfg, params, device=device)
    runner = DecodeRunner(dp.make_step(cfg, group), state, dp.fields(cfg), capture_sizes=sizes,
                          num_speculative_tokens=q_len - 1, backend=backend).capture()
    nreq = max(batch_sizes)
    sess = Session(cfg, nreq, [int(n) for n in torch.randint(3, 20, (nreq,), generator=torch.Generator().manual_seed(seed))])
    batch, ql = sess.prefill(list(range(nreq)))
    runner(batch, ql)
    assert runner.stats.last == "eager:prefill"
    twin = _clone_state(state)
    for bsz in batch_sizes:
        reqs = list(range(bsz))
        batch, ql = sess.decode(reqs, q_len)
        got = runner(batch, ql)
        assert runner.stats.last == f"graph:{pick_size(runner.sizes, bsz * q_len)}"
        want = _eager_step(cfg, group, twin, {k: v.to(device) for k, v in batch.items()}, ql)
        assert got.shape == want.shape == (bsz * q_len, cfg.hidden) and got.device == want.device
        assert (got - want).abs().max().item() <= TOL
        ref = sess.expected(params, reqs, q_len)
        assert torch.allclose(got.double().cpu(), ref, rtol=1e-4, atol=1e-4)
    for (k1, v1), (k2, v2) in zip(state["kv"], twin["kv"]):  # same slots written; padding wrote nothing
        for a, b in ((k1, k2), (v1, v2)):
            assert torch.equal(a.isnan(), b.isnan())
            assert (a.nan_to_num(0.0) - b.nan_to_num(0.0)).abs().max().item() <= TOL
    return runner


SMALL = dp.ProgramConfig(num_layers=1, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, block_size=8,
                         max_blocks=4, num_blocks=64)


@pytest.mark.slow
def test_aot_eager_every_size_and_padded_sizes():
    # every capture size (1, 2, 4, 8) and the padded ones (3, 5, 6, 7)
    runner = _check_decode(SMALL, "aot_eager", [1, 2, 4, 8], 1, [1, 2, 3, 4, 5, 6, 7, 8])
    assert runner.backend.compiles == 4  # one program per size, no recompilation on replay
    sess = Session(SMALL, 8, [3, 9, 1, 17, 5, 2, 11, 6], seed=5)  # other lengths and slots: only values change
    with torch._dynamo.config.patch(error_on_recompile=True):  # sizes in any order replay, never recompile
        for bsz in (8, 1, 5, 2, 3, 4):
            runner(*sess.decode(list(range(bsz))))
    assert runner.backend.compiles == 4


@needs_cuda
@pytest.mark.parametrize("q_len", [1, 2])
def test_cuda_graphs_every_size_and_padded_sizes(q_len):
    sizes = [n * q_len for n in (1, 2, 4, 8)]
    runner = _check_decode(SMALL, "cuda", sizes, q_len, [1, 2, 3, 4, 5, 6, 7, 8], device="cuda")
    assert runner.backend.compiles == 4 and runner.stats.graph == 8  # one graph per size, replays only


@pytest.mark.slow
def test_aot_eager_a2a_merge():
    runner = _check_decode(SMALL, "aot_eager", [4], 1, [3, 4, 1], merge="a2a")
    assert runner.stats.sizes == {4: 3}


@pytest.mark.slow
def test_speculative_decode_captured():
    runner = _check_decode(SMALL, "aot_eager", [2, 4, 8], 2, [1, 2, 3, 4])
    assert runner.stats.sizes == {2: 1, 4: 1, 8: 2}


@pytest.mark.slow
def test_inductor_capture_no_recompile():
    """Inductor compiles one size once; padded batches replay it. (One size: an inductor compile is the cost here;
    several sizes replaying in any order without a recompile: test_aot_eager_every_size_and_padded_sizes.)"""
    cfg = SMALL  # one layer: inductor compiles are slow on 2 cores
    runner = _check_decode(cfg, "cpu", [4], 1, [2, 1, 3, 4])
    assert runner.backend.name == "cpu" and runner.backend.compiles == 1
    sess = Session(cfg, 4, [3, 9, 1, 17], seed=5)  # other lengths and slots: only values change
    with torch._dynamo.config.patch(error_on_recompile=True):  # replays never recompile
        for bsz in (1, 2, 3, 4):
            runner(*sess.decode(list(range(bsz))))
    assert runner.backend.compiles == 1 and runner.stats.sizes == {4: 8}


@pytest.mark.slow
def test_eager_fallback_runs_the_same_step():
    group = _one_rank()
    params = dp.init_params(SMALL)
    state = dp.init_state(SMALL, params)
    runner = DecodeRunner(dp.make_step(SMALL, group), state, dp.fields(SMALL), capture_sizes=[1, 2],
                          backend=CompileBackend("aot_eager")).capture()
    sess = Session(SMALL, 3, [4, 7, 2])
    twin = _clone_state(state)
    steps = [sess.prefill([0, 1, 2]), sess.decode([0, 1]), sess.decode([0, 1, 2])]  # prefill, graph, oversized
    steps.append(sess.prefill([0]))  # a re-fed request (query_lens == its seq_len): prefill again
    b, _ = sess.decode([1, 2])
    mixed = {"x": torch.cat([b["x"], torch.randn(2, SMALL.hidden)]), "seq_lens": b["seq_lens"] + torch.tensor([0, 2]),
             "block_table": b["block_table"]}
    steps.append((mixed, [1, 3]))
    paths = []
    for batch, ql in steps:
        got = runner(batch, ql)
        paths.append(runner.stats.last)
        want = _eager_step(SMALL, group, twin, batch, ql)
        assert (got - want).abs().max().item() <= TOL
    assert paths == ["eager:prefill", "graph:2", "eager:oversized", "eager:prefill", "eager:mixed"]


# ----------------------------------------------------------------------------- static checks
def _bad_steps():
    def item(state, batch):
        return batch["x"] * batch["n"].max().item()

    def tolist(state, batch):
        return batch["x"] * sum(batch["n"].tolist())

    def mask(state, batch):
        return batch["x"][batch["n"] > 0].sum(0, keepdim=True).expand(batch["x"].shape[0], -1)

    def alloc(state, batch):
        return batch["x"].new_zeros(int(batch["n"].sum()), 2)[:3]

    def branch(state, batch):
        return batch["x"] * 2 if batch["n"][0] > 0 else batch["x"]

    return [item, tolist, mask, alloc, branch]


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
@pytest.mark.parametrize("bad", _bad_steps(), ids=lambda f: f.__name__)
def test_check_static_rejects_sync_alloc_and_branches(bad):
    batches = [{"x": torch.ones(3, 2), "n": torch.tensor([1, 2, 3])}, {"x": torch.ones(3, 2), "n": torch.tensor([0, 0, 1])}]
    with pytest.raises(StaticStepError):
        check_static(bad, {}, batches)
    runner = DecodeRunner(bad, {}, {"x": Field("token", (2,)), "n": Field("token", (), torch.int64)},
                          capture_sizes=[3], backend="aot_eager")
    with pytest.raises(RuntimeError, match="capturing the decode step for size 3"):
        runner.capture()


@pytest.mark.slow  # traced (torch.compile / opcheck): the full suite runs it, the fast lane does not
def test_check_static_shape_from_python_state_recompiles():
    calls = {"n": 1}

    def step(state, batch):  # reads a Python counter: a new constant each call -> recompiles
        calls["n"] += 1
        return batch["x"] * calls["n"]

    with pytest.raises(StaticStepError):
        check_static(step, {}, [{"x": torch.ones(2)}, {"x": torch.ones(2)}])


@pytest.mark.slow
@pytest.mark.parametrize("spec,merge,opaque", [(0, "ag_rs", False), (1, "a2a", False), (1, "ag_rs", True)])
def test_demo_program_is_static_under_aot_eager_fullgraph(spec, merge, opaque, monkeypatch):
    # torchair's precondition: torch.compile(backend="aot_eager", fullgraph=True), no recompile;
    # opaque: with the CPU decompositions off, the cpattn ops stay calls, as on an NPU
    if opaque:
        from cpattn.ops import registry

        monkeypatch.setattr(registry, "_DECOMPOSITIONS", {})
    cfg = dp.ProgramConfig(**{**SMALL.__dict__, "merge": merge})
    q = 1 + spec
    params = dp.init_params(cfg)
    state = dp.init_state(cfg, params, poison=0.0)
    sess = Session(cfg, 4, [5, 1, 12, 3])
    batches = []
    for reqs in ([0, 1, 2, 3], [2, 0, 3, 1]):
        b, ql = sess.decode(reqs, q)
        b["cu_seqlens_q"] = torch.tensor([0, *ql]).cumsum(0).to(torch.int32)
        batches.append(b)
    b = dict(batches[1])
    b["seq_lens"] = torch.tensor([30, 0, 2, 0])  # padding requests
    b["cu_seqlens_q"] = torch.tensor([0, q, q, 2 * q, 2 * q], dtype=torch.int32)
    batches.append(b)
    outs = check_static(dp.make_step(cfg, _one_rank()), state, batches)
    assert len(outs) == 3 and all(torch.isfinite(o).all() for o in outs)


# ----------------------------------------------------------------------------- backends
def test_backend_registry_and_errors():
    assert get_backend("auto", "cpu").name == "cpu"
    assert isinstance(get_backend("eager"), EagerBackend)
    assert {"eager", "cpu", "cuda", "npu", "torchair", "aot_eager", "auto"} <= set(backends())
    with pytest.raises(ValueError, match="unknown graph backend 'tpu'"):
        get_backend("tpu")
    register_backend("test_eager", EagerBackend)
    assert isinstance(get_backend("test_eager"), EagerBackend)
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="torch.cuda.is_available"):
            get_backend("cuda")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        for name in ("npu", "torchair"):
            with pytest.raises(BackendUnavailable, match="needs torch_npu"):
                get_backend(name)


# ----------------------------------------------------------------------------- DCP
def _dcp_run(group, cfg, params, backend, sizes, plan):
    """Prefill then decode steps on this rank; returns outputs and paths. ``plan``: [(kind, reqs)]."""
    state = dp.init_state(cfg, params, group.rank, group.size)
    runner = DecodeRunner(dp.make_step(cfg, group), state, dp.fields(cfg), capture_sizes=sizes, backend=backend)
    runner.capture()
    sess = Session(cfg, 6, [1, 3, 18, 0 + 2, 9, 30], seed=3)
    outs, paths, exp = [], [], []
    for kind, reqs in plan:
        batch, ql = sess.prefill(reqs) if kind == "prefill" else sess.decode(reqs)
        outs.append(runner(batch, ql))
        paths.append(runner.stats.last)
        if kind == "decode":
            exp.append(sess.expected(params, reqs, 1))
    return outs, paths, exp, runner.backend.compiles


PLAN = [("prefill", [0, 1, 2, 3, 4, 5]), ("decode", [0, 1, 2]), ("decode", [3, 4, 5, 0]), ("decode", [5]),
        ("decode", [0, 1, 2, 3, 4, 5])]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_dcp_program_simulated_eager_backend(n):
    # the simulated mesh's threads are not traceable: backend "eager" replays padded buffers
    cfg = dp.ProgramConfig(**{**SMALL.__dict__, "num_heads": 4 * n if n != 3 else 6, "interleave_size": 2, "max_blocks": 8,
                                         "num_layers": 2})
    params = dp.init_params(cfg)
    res = simulate(n, _dcp_run, cfg, params, "eager", [1, 2, 4], PLAN)
    outs, paths, exp, _ = res[0]
    # request 0's 1-token prompt looks like a decode row: the prefill batch is "mixed"
    assert paths == ["eager:mixed", "graph:4", "graph:4", "graph:1", "eager:oversized"]
    decodes = [o for o, (kind, _) in zip(outs, PLAN) if kind == "decode"]
    for got, want in zip(decodes, exp):
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)
    for r in range(1, n):  # every rank ends with the same (all-reduced) activations
        for a, b in zip(outs, res[r][0]):
            assert torch.allclose(a, b, atol=1e-5)


def gloo_capture(group, cfg, params):
    """Rank function: inductor-captured DCP program vs the simulated-free eager step, on real gloo."""
    torch.manual_seed(0)
    out = {}
    out["cpu"] = _dcp_run(group, cfg, params, "cpu", [4], PLAN)
    out["eager"] = _dcp_run(group, cfg, params, "eager", [4], PLAN)
    return out


@pytest.mark.slow
def test_dcp_program_captured_on_two_gloo_ranks():
    cfg = dp.ProgramConfig(**{**SMALL.__dict__, "num_heads": 4, "interleave_size": 1, "max_blocks": 8})
    params = dp.init_params(cfg, seed=1)
    res = spawn(2, gloo_capture, cfg, params, timeout_s=400)
    for rank in res:
        outs, paths, exp, compiles = rank["cpu"]
        assert compiles == 1
        assert paths == ["eager:mixed", "graph:4", "graph:4", "graph:4", "eager:oversized"]
        e_outs, e_paths, _, _ = rank["eager"]
        assert e_paths == paths
        for got, want in zip(outs, e_outs):
            assert (got - want).abs().max().item() <= TOL
        decodes = [o for o, (kind, _) in zip(outs, PLAN) if kind == "decode"]
        for got, want in zip(decodes, exp):
            assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)


def test_replay_pads_rows_a_bigger_batch_left_and_takes_buffer_views_as_they_are():
    """The padding rows of a replay are the field's pad whatever batches ran before (each replay sums every
    buffered row, padding included); an input that is a view of the runner's own buffer is used in place."""
    import torch

    from cpattn.graphs import DecodeRunner, Field

    def step(state, batch):
        x = batch["x"]  # [S] including the padding rows
        return x.sum().expand(x.shape[0]) + 0 * state["w"].sum()

    runner = DecodeRunner(step, {"w": torch.zeros(1)}, {"x": Field("token", (), torch.float32, pad=0.5)},
                          capture_sizes=[2, 4], backend="eager").capture()
    for n in (4, 1, 3, 2, 4, 3, 1):
        got = runner({"x": torch.ones(n)}, [1] * n)
        size = 2 if n <= 2 else 4
        assert runner.stats.last == f"graph:{size}"
        assert got.tolist() == [n + 0.5 * (size - n)] * n, n
    view = runner._buffers["x"][:3]
    view.copy_(torch.full((3,), 2.0))
    assert runner({"x": view}, [1, 1, 1]).tolist() == [6.5] * 3
