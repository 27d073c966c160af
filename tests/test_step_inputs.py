"""The runner's persistent step inputs: an incrementally updated block table equals one built from scratch
(a padded list per row) after any sequence of steps; unchanged rows cost no write; the block manager's
tuples stay the same object until a table changes; logits rows are the slices the spans name."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn.engine.blocks import BlockManager
from cpattn.engine.step_inputs import BlockTableRows, LogitRows

WIDTH, PAD = 6, 99


def fresh(tables):
    return [list(t) + [PAD] * (WIDTH - len(t)) for t in tables]


tables_st = st.lists(st.lists(st.integers(0, 20), max_size=WIDTH).map(tuple), max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(tables_st, min_size=1, max_size=8), st.integers(1, 4))
def test_incremental_table_equals_a_table_built_from_scratch(steps, rows):
    t = BlockTableRows(WIDTH, PAD, rows=rows)
    for tables in steps:
        assert t.update(tables).tolist() == fresh(tables)


def test_unchanged_rows_write_nothing_and_grown_rows_only_their_new_cells():
    t = BlockTableRows(WIDTH, PAD)
    a, b = (1, 2), (3,)
    t.update([a, b])
    assert t.writes == 3
    t.update([a, b])  # the same tuples
    t.update([(1, 2), (3,)])  # equal tuples
    assert t.writes == 3
    t.update([(1, 2, 4), (3,)])  # row 0 grew by one block
    assert t.writes == 4
    t.update([(3,), (1, 2, 4)])  # rows swapped: both rewritten (row 0 also pads its old cells)
    assert t.update([(3,), (1, 2, 4)]).tolist() == fresh([(3,), (1, 2, 4)])
    with pytest.raises(ValueError, match="request 'r' holds 7 blocks"):
        t.update([tuple(range(7))], ["r"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(tables_st.map(tuple), st.booleans()), min_size=1, max_size=10))
def test_the_same_tuple_of_tables_again_is_the_same_table(steps):
    """A tuple of tables handed again (a steady decode step) is answered from the last call; after any other
    tables, and with rows that are lists (they may change in place), it is rewritten as usual."""
    t, last = BlockTableRows(WIDTH, PAD, rows=2), None
    for tables, again in steps:
        tables = last if again and last is not None else tables
        before = t.writes
        assert t.update(tables).tolist() == fresh(tables)
        if tables is last:
            assert t.writes == before
        last = tables
    rows = ([1, 2], [3])
    t.update(rows)
    rows[0].append(4)  # changed in place: the same outer tuple, new contents
    assert t.update(rows).tolist() == fresh(rows)


def test_block_manager_tuples_change_only_with_the_table():
    bm = BlockManager(8, 2)
    assert bm.allocate("a", 3)
    t = bm.table_ids("a")
    assert t == (0, 1) and bm.table_ids("a") is t
    assert bm.allocate("a", 4) and bm.table_ids("a") is t  # covered already
    assert bm.allocate("a", 5) and bm.table_ids("a") == (0, 1, 2)
    t = bm.table_ids("a")
    bm.trim("a", 5)
    assert bm.table_ids("a") is t
    bm.trim("a", 2)
    assert bm.table_ids("a") == (0,)
    bm.free("a")
    assert bm.table_ids("a") == () and bm.block_table("a") == []


def test_logit_rows_are_the_spans_slices():
    logits = torch.randn(5, 3)
    rows = LogitRows(logits, {"x": (1, 3), 7: (4, 5)})
    assert dict(rows).keys() == {"x", 7} and "x" in rows and "y" not in rows
    assert torch.equal(rows["x"], logits[1:3]) and torch.equal({**rows}[7], logits[4:5])


def test_int64_is_torch_tensor_of_the_ints():
    from cpattn.engine.step_inputs import int64

    for xs in ([], [0], [5, -3, 2 ** 62], list(range(100))):
        got = int64(xs)
        assert got.dtype == torch.int64 and torch.equal(got, torch.tensor(xs, dtype=torch.int64))
    assert int64(iter([1, 2])).tolist() == [1, 2]


def test_one_token_rows_is_the_dict_of_model_outputs_and_spans():
    from cpattn.engine.scheduler import ModelOutput
    from cpattn.engine.step_inputs import OneTokenRows

    ids, toks = ("a", 7, ("t", 1)), [4, 5, 6]
    rows = OneTokenRows(ids, toks)
    assert dict(rows) == {r: ModelOutput((t,)) for r, t in zip(ids, toks)}
    assert dict(rows.spans) == {"a": (0, 1), 7: (1, 2), ("t", 1): (2, 3)}
    assert "b" not in rows and len(rows) == 3
    logits = torch.arange(6.).view(3, 2)
    assert LogitRows(logits, rows.spans)[7].tolist() == [[2.0, 3.0]]
    with pytest.raises(ValueError, match="one token per row"):
        OneTokenRows(ids, [1])


def test_request_output_without_init_is_the_dataclass():
    import dataclasses

    from cpattn.engine.outputs import RequestOutput, request_output

    args = (3, (1, 2), (9, 8), True, "stop", ({9: -0.5},))
    fast, slow = request_output(*args), RequestOutput(*args)
    assert fast == slow and hash(request_output(*args[:5])) == hash(RequestOutput(*args[:5]))
    assert repr(fast) == repr(slow) and dataclasses.asdict(fast) == dataclasses.asdict(slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.finished = False
