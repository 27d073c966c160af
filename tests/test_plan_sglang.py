"""pcp_break_even against a chosen baseline, and SGLang's static-CP short-request regression as an anchor
(sgl-project/sglang #37944: CP4 15-21% slower below ~4K tokens, break-even ~8K)."""

import pytest

from cpattn.plan.breakeven import pcp_break_even, pcp_ttfts
from cpattn.plan.model import Layout
from cpattn.plan.profiles import H200
from cpattn.plan.specs import get_model


def test_break_even_against_a_baseline_is_the_first_length_pcp_wins():
    spec, cp, base = get_model("glm-5", weights="fp8"), Layout(1, 4, dp=2), Layout(4, dp=2)
    n = pcp_break_even(spec, cp, H200, baseline=base, step=64)
    assert n is not None and n % 64 == 0
    won = [pcp_ttfts(spec, H200, cp, m, baseline=base) for m in (n - 64, n)]
    assert won[0][0] >= won[0][1] and won[1][0] < won[1][1]  # loses one step below, wins at n
    # a different question than against one rank of the same engine (the default baseline)
    assert pcp_break_even(spec, cp, H200, step=64) != n


def test_break_even_refuses_a_baseline_the_engine_refuses():
    with pytest.raises(ValueError, match="tp"):
        pcp_break_even(get_model("qwen3-235b-a22b"), Layout(2, 2), H200, baseline=Layout(3))


def test_sglang_anchor_reports_predicted_and_published():
    from cpattn.bench.perf.anchors import SGLANG_PUBLISHED, sglang_cp_anchor

    a = sglang_cp_anchor()
    assert a["published"] == SGLANG_PUBLISHED == {"slower_below": 4096, "slowdown": (0.15, 0.21), "break_even": 8192}
    assert a["break_even"] == pcp_break_even(get_model("glm-5", weights="fp8"), Layout(1, 4, dp=2), H200,
                                             baseline=Layout(4, dp=2))
    assert a["break_even_ratio"] == pytest.approx(a["break_even"] / 8192)
    for n, x in a["at"].items():
        assert x["slowdown"] == pytest.approx(x["cp_s"] / x["tp_s"] - 1)
