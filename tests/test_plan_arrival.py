"""Goodput under steady arrival (plan.arrival): the M/D/1 estimate of TTFT checked against a discrete-event
simulation written here (an independent oracle), and the --request-rate path of cpattn plan --objective goodput."""

import heapq
import json
import math

import numpy as np
import pytest

from cpattn.plan.arrival import arrival_goodput, at_rate, md1_wait


def simulate_fcfs(rate: float, service: float, n: int, servers: int = 1, seed: int = 0) -> np.ndarray:
    """TTFTs (wait + service) of ``n`` Poisson arrivals at ``rate``, each joining one of ``servers`` queues at
    random (a split Poisson process), each queue a FCFS server of deterministic ``service``: an event-driven
    simulation (arrival and departure events on one heap)."""
    rng = np.random.default_rng(seed)
    t, events = 0.0, []
    for i in range(n):
        t += rng.exponential(1.0 / rate)
        heapq.heappush(events, (t, 1, i, int(rng.integers(servers))))  # (time, kind 1 = arrival, id, queue)
    queues = [[] for _ in range(servers)]
    busy = [False] * servers
    arrived, ttft = {}, np.empty(n)
    while events:
        now, kind, i, q = heapq.heappop(events)
        if kind == 1:
            arrived[i] = now
            queues[q].append(i)
        else:  # kind 0: request i leaves queue q's server
            ttft[i] = now - arrived[i]
            busy[q] = False
        if not busy[q] and queues[q]:
            j = queues[q].pop(0)
            busy[q] = True
            heapq.heappush(events, (now + service, 0, j, q))
    return ttft


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.85])
def test_md1_ttft_matches_a_discrete_event_simulation(rho):
    service = 0.25
    n = 120_000 if rho > 0.8 else 40_000  # heavy load: a longer run for the same tail accuracy
    ttft = simulate_fcfs(rho / service, service, n, seed=int(rho * 100))
    est = {q: service + md1_wait(rho / service, service, q)["quantile"] for q in (0.5, 0.99)}
    mean = service + md1_wait(rho / service, service)["mean"]
    assert mean == pytest.approx(ttft.mean(), rel=0.05)
    assert est[0.99] == pytest.approx(np.quantile(ttft, 0.99), rel=0.05)
    assert est[0.5] == pytest.approx(np.quantile(ttft, 0.5), rel=0.05, abs=0.01 * service)


def test_md1_edges():
    assert md1_wait(0.0, 1.0)["quantile"] == 0.0 and md1_wait(0.0, 1.0)["mean"] == 0.0
    assert math.isinf(md1_wait(1.0, 1.0)["quantile"]) and math.isinf(md1_wait(2.0, 1.0)["mean"])
    with pytest.raises(ValueError, match="service"):
        md1_wait(1.0, 0.0)


def test_dp_replicas_split_the_arrivals():
    from cpattn.plan.model import Layout, Options
    from cpattn.plan.profiles import H200
    from cpattn.plan.specs import get_model

    spec, opts = get_model("deepseek-r1"), Options(output=64)
    one = at_rate(spec, H200, Layout(4), context=8192, rate=2.0, opts=opts)
    two = at_rate(spec, H200, Layout(4, dp=2), context=8192, rate=2.0, opts=opts)
    assert two["rho"] == pytest.approx(two["service_s"] * 1.0) and one["rho"] == pytest.approx(one["service_s"] * 2)
    sim = simulate_fcfs(2.0, two["service_s"], 60_000, servers=2, seed=3)  # the same split, simulated
    assert two["ttft_p99_s"] == pytest.approx(np.quantile(sim, 0.99), rel=0.05)


def test_arrival_goodput_is_the_largest_rate_meeting_the_slos():
    from cpattn.plan.model import Layout, Options
    from cpattn.plan.objective import SLO
    from cpattn.plan.profiles import H200
    from cpattn.plan.specs import get_model

    spec, opts, slo = get_model("deepseek-r1"), Options(output=256), SLO(ttft_s=1.0, tpot_s=0.05)
    g = arrival_goodput(spec, H200, Layout(8, 1, 8), context=8192, slo=slo, opts=opts, rate=1.0)
    r = g["max_rate"]
    below, above = (at_rate(spec, H200, Layout(8, 1, 8), context=8192, rate=x, opts=opts) for x in (r, 1.02 * r))
    assert slo.met(below["ttft_p99_s"], below["tpot_s"]) and not slo.met(above["ttft_p99_s"], above["tpot_s"])
    assert g["tokens_per_s_per_device"] == pytest.approx(r * 256 / 8) and g["meets_at_rate"] == (r >= 1.0)


def test_cli_request_rate(capsys):
    from cpattn.plan.cli import main

    argv = ["--model", "deepseek-r1", "--input-len", "8192", "--output-len", "256", "--objective", "goodput",
            "--ttft-slo", "1s", "--tpot-slo", "50ms", "--layout", "tp=8,dcp=8", "--layout", "tp=4,pcp=2"]
    assert main([*argv, "--request-rate", "2", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    g = data["predictions"][0]["parts"]["goodput"]
    assert data["request_rate"] == 2.0 and g["arrival"] == "poisson" and g["at"]["rate"] == 2.0
    assert main([*argv, "--json", "-"]) == 0  # without a rate: the burst model, as before
    assert "arrival" not in json.loads(capsys.readouterr().out)["predictions"][0]["parts"]["goodput"]
    with pytest.raises(SystemExit) as e:
        main(["--model", "deepseek-r1", "--request-rate", "2"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--objective goodput" in err
