"""``speculative_generate_on_rank(pcp=)`` (a bool) is the deprecated form of ``pcp_size=`` (issue 28 point 5)."""

import pytest
import torch


def test_speculative_on_rank_pcp_bool_is_pcp_size():
    from cpattn import simulate
    from cpattn.drafters.ngram import NgramDrafter
    from cpattn.engine.classic import speculative_generate_on_rank
    from cpattn.models import qwen3

    cfg = qwen3.Qwen3Config.tiny()
    params = qwen3.init_params(cfg, seed=0)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5]]

    def run(g, **kw):
        return speculative_generate_on_rank(g, "qwen3", params, cfg, prompts, 5, drafter=NgramDrafter(),
                                            num_speculative_tokens=2, **kw).tokens

    alone, over = simulate(2, run, pcp_size=1)[0], simulate(2, run, pcp_size=2)[0]
    with pytest.warns(DeprecationWarning, match="pass pcp_size=2"):
        old_alone = simulate(2, run, pcp=False)[0]
    with pytest.warns(DeprecationWarning, match="pass pcp_size=2"):
        old_over = simulate(2, run, pcp=True)[0]
    assert torch.equal(alone, old_alone) and torch.equal(over, old_over) and torch.equal(alone, over)
    with pytest.raises(RuntimeError, match="got pcp= and pcp_size="):  # simulate wraps the rank's TypeError
        simulate(2, run, pcp=True, pcp_size=2)
