"""cpattn.dsa.global_topk (the one key-sharded top-k under dsa_dcp_topk and the paged sharded_topk) equals the
single-device topk_indices of the whole score row, for any ownership of the keys, with ties and empty ranks."""

import pytest
import torch

from cpattn import simulate
from cpattn.dsa import global_topk
from cpattn.ops.dsa import topk_indices


@pytest.mark.parametrize("n, k, seed", [(1, 3, 0), (2, 4, 1), (3, 5, 2), (4, 8, 3)])
def test_global_topk_equals_one_device(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    t, s = 5, 13
    scores = torch.randint(0, 4, (t, s), generator=g).float()  # few values: many ties
    scores[torch.rand(t, s, generator=g) < 0.3] = float("-inf")  # invisible keys
    scores[0] = float("-inf")  # a row with no visible key
    owner = torch.randint(0, n, (s,), generator=g)
    owner[owner == n - 1] = 0 if n > 1 else owner[owner == n - 1]  # the last rank owns no key (n > 1)
    want = topk_indices(scores, k).long()  # [T, k], -1 padded

    def rank(grp):
        ids = (owner == grp.rank).nonzero()[:, 0]  # ascending global ids of this rank's keys
        return global_topk(scores[:, ids], lambda j: ids[j], k, group=grp)

    for got in simulate(n, rank):
        assert torch.equal(got, want)
