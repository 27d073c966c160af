"""cpattn plan anchors as absolute numbers: predicted over published TTFT / tokens/s per cell, the DCP anchor
without its assumed prefix hits, and the Llama3-405B 1M-token CP prefill on 128 H100 (arXiv 2411.01783)."""

import json

import pytest

from cpattn.bench.perf.anchors import LLAMA_PUBLISHED_S, PCP_PUBLISHED, dcp_anchor, llama_anchor, pcp_anchor


def test_pcp_anchor_reports_absolute_factors_per_cell():
    rows = pcp_anchor()
    published = {(r["model"], r["context"]) for r in rows}
    assert len(published) == sum(len(cells) for _, cells in PCP_PUBLISHED.values())
    for r in rows:
        assert r["abs_base"] == pytest.approx(r["ttft_base_s"] / r["published_base_s"])
        assert r["abs_pcp"] == pytest.approx(r["ttft_pcp2_s"] / r["published_pcp_s"])


def test_dcp_anchor_absolute_and_without_prefix_hits():
    d, bare = dcp_anchor(), dcp_anchor(prefix_hit=0.0)
    for k in ("tp8", "tp8_dcp8"):
        assert d["abs"][k] == pytest.approx(d[k]["tokens_per_s_per_gpu"] / d["published"][k])
    assert bare["prefix_hit"] == 0.0 and bare["ratio"] < d["ratio"]  # the ratio leans on the assumed hits


def test_llama_anchor_lands_near_the_published_77_s():
    a = llama_anchor()
    assert a["devices"] == 128 and a["published_s"] == LLAMA_PUBLISHED_S == 77.0
    assert a["abs"] == pytest.approx(a["ttft_s"] / 77.0) and 0.85 <= a["abs"] <= 1.15
    assert a["parts"]["attention"] > a["parts"]["gemm"]  # at 1M tokens attention dominates


def test_cli_anchors_print_absolute_numbers(capsys):
    from cpattn.bench.perf.cli import main

    assert main(["anchors", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["llama"]["published_s"] == 77.0 and "abs" in data["dcp"] and "abs_pcp" in data["pcp"][0]
    assert main(["anchors"]) == 0
    out = capsys.readouterr().out
    assert "absolute (predicted / published TTFT" in out and "Llama3-405B" in out and "prefix-cache hits" in out
