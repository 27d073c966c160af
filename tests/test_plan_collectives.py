"""cpattn.plan prices small messages as the libraries do: vLLM's custom all-reduce by its size rule, NCCL's
protocols by its tuner's constants (the cheapest wins: the message-size switch), alpha-beta rings elsewhere."""

import pytest

from cpattn.plan import Layout, get_model, get_profile, predict
from cpattn.plan.collectives import choose, entry_time
from cpattn.plan.costs import collective_time
from cpattn.plan.profiles import CPU_DEFAULT, NCCL_NVLINK, VLLM_CUSTOM_AR

H200 = get_profile("h200")
KB, MB = 1024, 1024 * 1024


def test_vllm_custom_all_reduce_follows_its_size_rule():
    for n, below, above in [(8, 256 * KB - 2, 256 * KB), (4, 512 * KB - 2, 512 * KB)]:
        assert choose(H200, "all_reduce", below, n)[1] == "vllm custom all-reduce 1-stage"
        assert choose(H200, "all_reduce", above, n)[1] == "vllm custom all-reduce 2-stage"
    assert choose(H200, "all_reduce", 4 * MB, 2)[1] == "vllm custom all-reduce 1-stage"  # world size 2: always
    assert choose(H200, "all_reduce", 8 * MB, 8)[1].startswith("nccl")  # past max_size 8 MB: NCCL
    assert choose(H200, "all_reduce", 1 * KB, 16, crosses_nodes=True)[1].startswith("nccl")  # one node only


def test_nccl_picks_the_cheapest_protocol_and_switches_with_size():
    beta = H200.links["intra"].beta
    picks = []
    for size in (1 * KB, 64 * KB, 1 * MB, 64 * MB):
        t, name = choose(H200, "all_gather", size, 8)
        times = {e["name"]: entry_time(e, "all_gather", size, 8, beta) for e in NCCL_NVLINK}
        assert name == min(times, key=times.get) and t == pytest.approx(min(times.values()))
        picks.append(name)
    assert picks[0] == "nccl ring LL" and picks[-1] == "nccl ring Simple"  # LL below, Simple above


def test_r1_decode_all_reduce_is_priced_at_the_one_shot_latency():
    # R1, batch 1, 128K, TP8 on H200: 64 all-reduces of one token's hidden (14 KB) a step
    spec = get_model("deepseek-r1")
    p = predict(spec, H200, Layout(8), context=131072, batch=1)
    count = sum(1 if spec.mlp_params(i)[1] else 2 for i in range(spec.layers))
    one = entry_time(VLLM_CUSTOM_AR[0], "all_reduce", spec.hidden * 2, 8, H200.links["intra"].beta)
    assert count == 64 and p.parts["decode"]["tp_comm"] == pytest.approx(count * one)
    ring = collective_time("all_reduce", spec.hidden * 2, 8, H200.links["intra"])  # 14 steps x alpha
    assert p.parts["decode"]["tp_comm"] < count * ring / 10


def test_dcp_merge_latency_no_longer_grows_past_the_kv_saving():
    spec = get_model("deepseek-r1")
    tpot = {d: predict(spec, H200, Layout(8, 1, d), context=131072, batch=1).tpot_s for d in (1, 2, 4, 8)}
    assert tpot[8] <= tpot[4] <= tpot[2] <= tpot[1]


def test_profiles_without_library_tables_keep_the_ring():
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        t, name = choose(CPU_DEFAULT, kind, 1e5, 2)
        assert name == "alpha-beta ring" and t == collective_time(kind, 1e5, 2, CPU_DEFAULT.links["intra"])
    for prof in ("h200", "b200", "ascend-910c"):
        assert get_profile(prof).sources["collectives"] and get_profile(prof).collectives["intra"]
