"""``cpattn serve --pcp-policy elastic`` and P/D (``--kv-transfer-config``): refusals, served tokens, /metrics.

The refusals run in-process (one line on stderr, exit 2, before any engine is built). The served layouts
start the real server in a subprocess (test_serve_flags' ``Served``) and are talked to by the real
``openai`` client; every token is compared with one-device greedy generation of the same weights, and
/metrics shows what ran: under elastic CP only the long prompt's chunk ran PCP; under P/D both roles
stepped and every request was handed off; the TTFT / TPOT histograms count every finished request.
"""

from __future__ import annotations

import sys
import urllib.request

import pytest
from test_serve_flags import Served, _free_port, _greedy, _refusal, embedded, needs_serving  # noqa: F401

KV = '{"kv_role": "kv_both", "kv_connector": "CpattnPoolConnector"}'
SHORT = [3, 14, 15, 92, 65]  # 5 tokens: under the 16-token threshold -> DCP attention
LONG = [2, 71, 82, 81, 82, 84, 59, 4, 5, 23, 53, 60, 28, 74, 71, 35, 26, 62, 31, 7, 9, 11, 13, 17, 19, 21, 23, 29,
        31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79]  # 40 tokens, one chunk -> PCP


@pytest.mark.parametrize("argv,said", [
    (["--pcp-policy", "elastic"], ["argument --pcp-policy", "--pcp=1", "needs --pcp > 1", "add --pcp 2 --dcp 2"]),
    (["--pcp", "2", "--dcp", "2", "--pcp-min-tokens", "8"], ["argument --pcp-min-tokens", "add --pcp-policy elastic"]),
    (["--pcp", "2", "--dcp", "2", "--pcp-policy", "sometimes"], ["--pcp-policy", "'sometimes'"]),
    (["--kv-pool", "memory"], ["argument --kv-pool", "P/D's connector", "--kv-transfer-config"]),
    (["--kv-transfer-config", '{"kv_role": "kv_both"}', "--kv-pool", "redis:x"], ["argument --kv-pool", "redis:x",
                                                                                  "lmdb:DIR"]),
    (["--kv-transfer-config", '{"kv_role": "kv_producer"}'], ["argument --kv-pool", "kv_role kv_producer",
                                                              "two processes", "lmdb:DIR"]),
    (["--kv-transfer-config", '{"kv_role": "kv_consumer"}', "--kv-pool", "memory"], ["argument --kv-pool",
                                                                                     "memory with kv_role"]),
    (["--kv-transfer-config", '{"kv_role": "both"}'], ["--kv-transfer-config", 'kv_role="both"', "kv_producer"]),
    (["--kv-transfer-config", KV, "--kv-pool", "memory", "--distributed-executor-backend", "mp"],
     ["argument --kv-pool", "memory with --distributed-executor-backend mp", "drop --kv-pool"]),
    (["--distributed-executor-backend", "external_launcher"], ["argument --distributed-executor-backend",
                                                               "outside torchrun", "use mp"]),
    (["--kv-transfer-config", '{"kv_role": "kv_both", "kv_connector": "NixlConnector"}'],
     ["kv_connector=\"NixlConnector\"", "vLLM connector", "CpattnPoolConnector"]),
    (["--kv-transfer-config", '{"kv_role": "kv_both", "kv_buffer_size": 5}'], ["saw key 'kv_buffer_size'"]),
    (["--kv-transfer-config", "kv_both"], ["--kv-transfer-config", "not JSON"]),
    (["--pcp", "2", "--dcp", "2", "--pcp-policy", "elastic", "--kv-transfer-config", KV],
     ["argument --pcp-policy", "P/D prefill role"]),
    (["--pcp", "2", "--dcp", "2", "--kv-transfer-config", KV, "--speculative-config",
      '{"method": "ngram", "num_speculative_tokens": 2}'], ["argument --speculative-config", "no drafter"]),
])
def test_elastic_and_pd_flag_refusals_exit_2(argv, said, capsys):
    err = _refusal([*argv, "--port", str(_free_port())], capsys)
    assert err.startswith("cpattn serve: error: argument --"), err
    for piece in said:
        assert piece in err, (piece, err)


def test_pd_flags_parse_to_the_pair():
    from cpattn.serve import cli as serve_cli

    a = serve_cli.parser().parse_args(["--pcp", "2", "--dcp", "1", "--kv-transfer-config", KV, "--kv-pool",
                                       "lmdb:/tmp/cpattn-pd-pool"])
    assert a.kv_transfer_config == {"kv_connector": "CpattnPoolConnector", "kv_role": "kv_both"}
    serve_cli.check_args(a)  # --pcp 2 with --dcp 1 is a P/D pair, not the one-engine refusal
    assert "P/D: prefill PCP 2 -> decode DCP 1 via KV pool lmdb:/tmp/cpattn-pd-pool" in serve_cli.describe(a, None)


# ----------------------------------------------------------------------------- /metrics
def _metrics_text(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def _values(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))}


def _histogram(text: str, name: str) -> tuple[list[tuple[str, float]], float, float]:
    """(the (le, cumulative count) buckets in order, _sum, _count) of one histogram, checked for shape."""
    assert f"# TYPE {name} histogram" in text, text
    buckets, total, count = [], None, None
    for ln in text.splitlines():
        if ln.startswith(name + "_bucket{le=\""):
            le = ln[len(name) + len('_bucket{le="'):].split('"', 1)[0]
            buckets.append((le, float(ln.rsplit(" ", 1)[1])))
        elif ln.startswith(name + "_sum "):
            total = float(ln.split()[1])
        elif ln.startswith(name + "_count "):
            count = float(ln.split()[1])
    assert buckets and buckets[-1][0] == "+Inf" and buckets[-1][1] == count, buckets
    assert [float(le) for le, _ in buckets[:-1]] == sorted(float(le) for le, _ in buckets[:-1])
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets  # cumulative
    return buckets, total, count


def _serve(argv: list[str]) -> Served:
    port = _free_port()
    return Served([sys.executable, "-m", "cpattn", "serve", "--model-type", "qwen3", "--block-size", "4",
                   "--max-num-batched-tokens", "64", "--max-model-len", "256", *argv, "--port", str(port)], port)


@pytest.mark.slow
@needs_serving
def test_elastic_server_runs_pcp_for_the_long_prompt_only(embedded):
    """--pcp 2 --dcp 2 --pcp-policy elastic --pcp-min-tokens 16: the 5-token prompt's chunk runs DCP
    attention (no PCP step), the 40-token prompt's chunk runs PCP; tokens equal one device both ways;
    the TTFT / TPOT histograms count both finished requests."""
    srv = _serve(["--pcp", "2", "--dcp", "2", "--pcp-policy", "elastic", "--pcp-min-tokens", "16"])
    try:
        client = srv.client()
        m0 = _values(_metrics_text(srv.base))
        r = client.completions.create(model="cpattn-qwen3", prompt=SHORT, max_tokens=5, temperature=0)
        assert list(r.choices[0].model_extra["token_ids"]) == _greedy(embedded, SHORT, 5)
        m1 = _values(_metrics_text(srv.base))
        assert m1["cpattn_pcp_steps_total"] == m0["cpattn_pcp_steps_total"], m1  # short: no PCP
        assert m1["cpattn_steps_total"] > m0["cpattn_steps_total"]
        stream = client.completions.create(model="cpattn-qwen3", prompt=LONG, max_tokens=5, temperature=0,
                                           stream=True)
        assert sum((list(c.choices[0].model_extra["token_ids"]) for c in stream if c.choices), []) == \
            _greedy(embedded, LONG, 5)
        text = _metrics_text(srv.base)
        assert _values(text)["cpattn_pcp_steps_total"] == m1["cpattn_pcp_steps_total"] + 1, text  # its one chunk
        for name in ("cpattn_time_to_first_token_seconds", "cpattn_time_per_output_token_seconds"):
            _, total, count = _histogram(text, name)
            assert count == 2 and total > 0, (name, count, total)  # both requests finished (5 tokens each)
    finally:
        assert srv.stop() == 0, srv.proc.stderr.read()


@pytest.mark.slow
@needs_serving
def test_pd_server_hands_every_request_from_prefill_to_decode(embedded):
    """--pcp 2 --dcp 2 --kv-transfer-config kv_both: a PCP 2 prefill role and a DCP 2 decode role in one
    process; the tokens equal one device, /metrics shows both roles' steps, the pool's blocks stored by
    the prefill role and fetched by the decode role, every request handed off, and the histograms count
    the finished requests."""
    srv = _serve(["--pcp", "2", "--dcp", "2", "--kv-transfer-config", KV])
    try:
        client = srv.client()
        r = client.completions.create(model="cpattn-qwen3", prompt=[SHORT, LONG], max_tokens=6, temperature=0)
        got = [list(c.model_extra["token_ids"]) for c in sorted(r.choices, key=lambda c: c.index)]
        assert got == [_greedy(embedded, SHORT, 6), _greedy(embedded, LONG, 6)]
        stream = client.completions.create(model="cpattn-qwen3", prompt=LONG[::-1], max_tokens=4, temperature=0,
                                           stream=True)
        assert sum((list(c.choices[0].model_extra["token_ids"]) for c in stream if c.choices), []) == \
            _greedy(embedded, LONG[::-1], 4)
        text = _metrics_text(srv.base)
        m = _values(text)
        assert m['cpattn_steps_total{role="prefill"}'] > 0 and m['cpattn_steps_total{role="decode"}'] > 0, text
        assert m['cpattn_pcp_steps_total{role="prefill"}'] > 0 and m['cpattn_pcp_steps_total{role="decode"}'] == 0
        assert m['cpattn_kv_pool_blocks_stored_total{role="prefill"}'] > 0, text
        assert m['cpattn_kv_pool_hit_tokens_total{role="decode"}'] > 0, text  # the KV came over the pool
        assert m["cpattn_handed_off_requests_total"] == 3
        for name in ("cpattn_time_to_first_token_seconds", "cpattn_time_per_output_token_seconds"):
            assert _histogram(text, name)[2] == 3, name
    finally:
        assert srv.stop() == 0, srv.proc.stderr.read()
