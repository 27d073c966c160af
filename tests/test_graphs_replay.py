"""DecodeRunner's replay of a uniform decode batch (the step loop's every decode step): query lengths as a
list, a tuple or a tensor take the same path; a wrong input shape or key is refused on it with the general
message; outputs of any pytree come back cut to the real rows; a second capture drops the views of the old
buffers (the rows a replay reads are the new buffers')."""

import pytest
import torch

from cpattn.graphs import DecodeRunner, Field


def _runner(out_kind: str = "tuple"):
    seen = []

    def step(state, batch):
        seen.append({k: v.clone() for k, v in batch.items()})
        x, seq = batch["x"] * 2, batch["seq"] + 0
        return {"x": x, "seq": seq} if out_kind == "dict" else (x, seq)

    fields = {"x": Field("token", (2,), pad=0.0), "seq": Field("request", (), torch.int64, pad=0)}
    return DecodeRunner(step, {"w": torch.zeros(1)}, fields, capture_sizes=[2, 4], backend="eager").capture(), seen


@pytest.mark.parametrize("lens", [[1, 1, 1], (1, 1, 1), torch.tensor([1, 1, 1])])
def test_a_uniform_batch_replays_whatever_holds_its_query_lens(lens):
    runner, seen = _runner()
    x, seq = runner({"x": torch.ones(3, 2), "seq": torch.tensor([4, 5, 6])}, lens)
    assert runner.stats.last == "graph:4" and runner.stats.padded_tokens == 1
    assert x.shape == (3, 2) and x.eq(2).all() and seq.tolist() == [4, 5, 6]
    assert seen[-1]["seq"].tolist() == [4, 5, 6, 0] and seen[-1]["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 3]


def test_wrong_shapes_and_keys_are_refused_on_the_replay_path():
    runner, _ = _runner()
    with pytest.raises(ValueError, match=r"batch\['seq'\] has shape \(2,\) but Field\(rows='request'\)"):
        runner({"x": torch.ones(3, 2), "seq": torch.tensor([4, 5])}, [1, 1, 1])
    with pytest.raises(ValueError, match=r"missing \['seq'\], unexpected \['y'\]"):
        runner({"x": torch.ones(3, 2), "y": torch.tensor([4, 5, 6])}, [1, 1, 1])
    with pytest.raises(ValueError, match=r"missing \['seq'\]"):
        runner({"x": torch.ones(3, 2)}, [1, 1, 1])


def test_dict_outputs_are_cut_too():
    runner, _ = _runner("dict")
    out = runner({"x": torch.ones(1, 2), "seq": torch.tensor([9])}, [1])
    assert runner.stats.last == "graph:2" and out["x"].shape == (1, 2) and out["seq"].tolist() == [9]


def test_a_second_capture_replays_from_its_own_buffers():
    runner, seen = _runner()
    runner({"x": torch.ones(3, 2), "seq": torch.tensor([4, 5, 6])}, [1, 1, 1])
    old = runner._buffers["seq"]
    runner.capture()
    assert runner._buffers["seq"] is not old
    x, seq = runner({"x": torch.full((3, 2), 3.0), "seq": torch.tensor([7, 8, 9])}, [1, 1, 1])  # the same rows
    assert seq.tolist() == [7, 8, 9] and x.eq(6).all() and seen[-1]["seq"].tolist() == [7, 8, 9, 0]
    assert old.tolist() == [4, 5, 6, 0]  # the old buffer is no longer written
