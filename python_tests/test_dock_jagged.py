"""msrl_core.dock._jagged: jagged NestedTensors and TensorDicts (nested and non-tensor entries) in and out
of the dock's ragged and object columns. The codecs directly, then end to end through the Dock on main.

Also checked against tensordict 0.10.0 (TransferQueue's floor): unpack its wheel into a folder and run
this file with that folder first on PYTHONPATH."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from msrl_core import Column, Dock, Padded, Ragged
from msrl_core.dock import _jagged, _objects
from msrl_core.errors import InvalidArgument

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
TensorDict, NonTensorData, NonTensorStack = (
    tensordict.TensorDict,
    tensordict.NonTensorData,
    tensordict.NonTensorStack,
)

ROWS = [torch.arange(3), torch.arange(5) + 10, torch.arange(0), torch.arange(1) + 7]
CHATS = [
    [{"role": "user", "content": "héllo"}],
    [],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": ""}],
]


def jagged(rows):
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def strided(rows):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the strided layout is a prototype
        return torch.nested.nested_tensor(rows)


def test_from_nested_is_zero_copy_for_contiguous_rows():
    nt = jagged(ROWS)
    values, lengths = _jagged.from_nested(nt, "responses")
    assert lengths.dtype == np.int64 and lengths.tolist() == [3, 5, 0, 1]
    assert values.data_ptr() == nt.values().data_ptr()  # the NestedTensor's own buffer
    assert torch.equal(values, torch.cat(ROWS))


def test_from_nested_with_inner_dims_and_on_rows_with_holes():
    nt = jagged([torch.randn(2, 4), torch.randn(3, 4)])
    values, lengths = _jagged.from_nested(nt)
    assert values.shape == (5, 4) and lengths.tolist() == [2, 3]
    assert torch.equal(values, torch.cat(nt.unbind()))
    base = torch.arange(24.0).view(4, 6)
    holes = torch.nested.narrow(
        base, 1, torch.tensor([1, 0, 4, 2]), torch.tensor([2, 6, 0, 3]), layout=torch.jagged
    )
    assert holes.lengths() is not None  # rows are not back to back
    values, lengths = _jagged.from_nested(holes)
    assert lengths.tolist() == [2, 6, 0, 3]
    assert values.tolist() == [1.0, 2.0, *range(6, 12), 20.0, 21.0, 22.0]


def test_wrong_layouts_are_clear_errors():
    with pytest.raises(
        InvalidArgument, match=r"column 'responses': .*layout torch\.strided.*allowed: a torch\.jagged"
    ):
        _jagged.from_nested(strided(ROWS[:2]), "responses")
    transposed = jagged([torch.zeros(3, 4), torch.zeros(2, 4)]).transpose(1, 2)
    with pytest.raises(InvalidArgument, match="ragged dimension is 2"):
        _jagged.from_nested(transposed, "h")
    with pytest.raises(InvalidArgument, match="expected a NestedTensor"):
        _jagged.from_nested(torch.zeros(2, 3), "h")


def test_to_nested_is_a_view_of_the_fetched_values_and_pads_like_torch():
    values = torch.arange(9, dtype=torch.int64)
    nt = _jagged.to_nested(values, np.array([3, 5, 0, 1]))
    assert nt.layout == torch.jagged and nt.values().data_ptr() == values.data_ptr()
    assert nt.offsets().tolist() == [0, 3, 8, 8, 9]
    padded = _jagged.pad(values, [3, 5, 0, 1], value=-1)
    assert torch.equal(nt.to_padded_tensor(-1), padded.values)
    assert padded.mask.tolist()[2] == [False] * 5 and padded.mask.sum().item() == 9
    ro = np.arange(4, dtype=np.int32)
    ro.flags.writeable = False  # a zero-copy view of the dock comes read-only
    assert _jagged.to_nested(ro, [4]).values().tolist() == [0, 1, 2, 3]
    with pytest.raises(InvalidArgument, match="add up to 4 items but values have 9"):
        _jagged.to_nested(values, [4])


def test_pad_numpy_inner_dims_and_empty():
    vals = np.arange(10, dtype=np.float32).reshape(5, 2)
    p = _jagged.pad(vals, [2, 0, 3])
    assert p.values.shape == (3, 3, 2) and p.values[0, :2].tolist() == [[0, 1], [2, 3]]
    assert p.values[1].tolist() == [[0, 0]] * 3 and p.values[2].tolist() == [[4, 5], [6, 7], [8, 9]]
    assert _jagged.pad(np.zeros(0, np.int64), []).values.shape == (0, 0)


def test_ragged_output_layouts():
    vals = torch.arange(4)
    assert isinstance(_jagged.ragged_output(vals, [1, 3], "packed"), Ragged)
    assert isinstance(_jagged.ragged_output(vals, [1, 3], "padded"), Padded)
    assert _jagged.ragged_output(vals, [1, 3], "nested").offsets().tolist() == [0, 1, 4]
    with pytest.raises(InvalidArgument, match=r"layout must be one of \('packed', 'padded', 'nested'\)"):
        _jagged.ragged_output(vals, [1, 3], "strided")


def full_tensordict() -> TensorDict:
    return TensorDict(
        {
            "rewards": torch.tensor([0.5, 1.0, -1.0, 2.0]),
            "responses": jagged(ROWS),
            "extra": {"old_log_prob": jagged([r.float() * 0.5 for r in ROWS]), "mask": torch.ones(4, 2)},
            "uid": NonTensorStack.from_list(["u0", "ü1", "", "u3"]),
            "raw_prompt": NonTensorStack(*[NonTensorData(c) for c in CHATS], stack_dim=0),
            "step": NonTensorData(7, batch_size=[4]),
        },
        batch_size=[4],
    )


def test_tensordict_to_columns():
    cols = _jagged.tensordict_to_columns(full_tensordict())
    assert sorted(cols) == sorted(
        ["rewards", "responses", "extra.old_log_prob", "extra.mask", "uid", "raw_prompt", "step"]
    )
    assert torch.equal(cols["rewards"], torch.tensor([0.5, 1.0, -1.0, 2.0]))
    assert isinstance(cols["responses"], Ragged) and cols["responses"].lengths.tolist() == [3, 5, 0, 1]
    assert torch.equal(cols["responses"].values, torch.cat(ROWS))
    assert cols["extra.old_log_prob"].values.dtype == torch.float32
    assert cols["extra.mask"].shape == (4, 2)
    assert isinstance(cols["uid"], _jagged.ObjectValues) and list(cols["uid"]) == ["u0", "ü1", "", "u3"]
    assert cols["uid"].dtype == object and cols["uid"].shape == (4,)
    assert list(cols["raw_prompt"]) == CHATS  # list values stay one per row (not stacked into 2-D)
    assert list(cols["step"]) == [7, 7, 7, 7]  # NonTensorData: its one value for every row


def test_bad_tensordicts_are_refused():
    with pytest.raises(InvalidArgument, match=r"column 'extra\.r': .*strided"):
        _jagged.tensordict_to_columns(TensorDict({"extra": {"r": strided(ROWS[:2])}}, batch_size=[2]))
    with pytest.raises(InvalidArgument, match=r"batch_size \[rows\], got \[2, 3\]"):
        _jagged.tensordict_to_columns(TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(InvalidArgument, match="separator"):
        _jagged.tensordict_to_columns(TensorDict({"a.b": torch.zeros(2)}, batch_size=[2]))
    with pytest.raises(InvalidArgument, match="empty TensorDict"):
        _jagged.tensordict_to_columns(TensorDict({}, batch_size=[2]))


def test_columns_to_tensordict_nested_and_padded():
    data = {
        "rewards": torch.tensor([1.0, 2.0]),
        "responses": Ragged.from_lengths(torch.arange(5), [2, 3]),
        "extra.lp": Ragged.from_lengths(np.arange(5, dtype=np.float32), [4, 1]),
        "uid": ["a", "b"],
        "raw_prompt": CHATS[:2],
    }
    td = _jagged.columns_to_tensordict(data, 2)
    assert td.batch_size == torch.Size([2])
    assert td["responses"].layout == torch.jagged and td["responses"].offsets().tolist() == [0, 2, 5]
    assert td["extra", "lp"].offsets().tolist() == [0, 4, 5]
    assert td.get("uid").tolist() == ["a", "b"] and td.get("raw_prompt").tolist() == CHATS[:2]
    td = _jagged.columns_to_tensordict(data, 2, ragged="padded")
    assert td["responses"].tolist() == [[0, 1, 0], [2, 3, 4]]
    assert td["responses_mask"].tolist() == [[True, True, False], [True, True, True]]
    assert td["extra", "lp_mask"].sum().item() == 5
    with pytest.raises(InvalidArgument, match="'a' is also a column"):
        _jagged.columns_to_tensordict({"a": torch.zeros(2), "a.b": torch.zeros(2)}, 2)
    with pytest.raises(InvalidArgument, match="'x_mask', which is also a column"):
        _jagged.columns_to_tensordict(
            {"x": Ragged.from_lengths(torch.arange(2), [1, 1]), "x_mask": torch.zeros(2)}, 2, "padded"
        )
    with pytest.raises(InvalidArgument, match="ragged must be"):
        _jagged.columns_to_tensordict(data, 2, ragged="packed")


# ---- end to end through the Dock on main ---------------------------------------------------------

OBJECTS = ("uid", "raw_prompt", "step")


def test_tensordict_round_trip_through_the_dock():
    td_in = full_tensordict()
    cols = _jagged.tensordict_to_columns(td_in)
    columns = {
        "rewards": Column("float32"),
        "responses": Column("int64", ragged=True, max_len=8),
        "extra.old_log_prob": Column("float32", ragged=True, max_len=8),
        "extra.mask": Column("float32", shape=(2,)),
        **{name: Column("uint8", ragged=True, max_len=64) for name in OBJECTS},  # object columns
    }
    dock = Dock(columns=columns, stages={"train": list(columns)}, capacity=8, group_size=2, output="torch")
    put = {}
    for name, value in cols.items():
        if isinstance(value, _jagged.ObjectValues):
            flat, lengths = _objects.encode(value, name)
            value = Ragged.from_lengths(flat, lengths)
        put[name] = value
    rows = dock.put(put)
    batch = dock.take("train", max_rows=8)
    order = [int(np.flatnonzero(rows == r)[0]) for r in batch.rows]
    out = {}
    for name in columns:
        v = batch[name]
        if name in OBJECTS:
            out[name] = _objects.decode(v.values.numpy(), v.lengths, name)
        else:
            out[name] = v
    td_out = _jagged.columns_to_tensordict(out, len(batch.rows))
    assert torch.equal(td_out["rewards"], td_in["rewards"][order])
    for key in ("responses", ("extra", "old_log_prob")):
        got = td_out[key]
        assert got.layout == torch.jagged
        src = td_in[key].unbind()
        assert [r.tolist() for r in got.unbind()] == [src[i].tolist() for i in order]
    assert torch.equal(td_out["extra", "mask"], td_in["extra", "mask"][order])
    assert td_out.get("uid").tolist() == [["u0", "ü1", "", "u3"][i] for i in order]
    assert td_out.get("raw_prompt").tolist() == [CHATS[i] for i in order]
    assert td_out.get("step").tolist() == [7] * 4


def test_tensordict_round_trip_through_the_keyed_dock():
    td_in = full_tensordict()
    dock = Dock(capacity=8)
    keys = ["k0", "k1", "k2", "k3"]
    dock.put(td_in, partition="train", keys=keys)
    padded = dock.get(keys, partition="train", output="tensordict")  # ragged padded + masks, objects too
    assert padded["responses"].shape == (4, 5) and padded["responses_mask"].sum().item() == 9
    assert padded.get("raw_prompt").tolist() == CHATS and padded.get("uid").tolist() == ["u0", "ü1", "", "u3"]
    assert dock.columns["responses"].ragged and dock.columns["uid"].is_object
    assert not dock.columns["extra.mask"].ragged  # dense stays dense
    order = [3, 1, 0, 2]
    td = dock.get([keys[i] for i in order], partition="train", output="tensordict", layout="nested")
    assert td.batch_size == torch.Size([4])
    for key in ("responses", ("extra", "old_log_prob")):
        assert td[key].layout == torch.jagged
        src = td_in[key].unbind()
        assert [r.tolist() for r in td[key].unbind()] == [src[i].tolist() for i in order]
    assert td["responses"].to_padded_tensor(-1).shape == (4, 5)  # padded to the longest row
    assert torch.equal(td["rewards"], td_in["rewards"][order])
    assert torch.equal(td["extra", "mask"], td_in["extra", "mask"][order])
    assert td.get("uid").tolist() == [["u0", "ü1", "", "u3"][i] for i in order]
    assert td.get("raw_prompt").tolist() == [CHATS[i] for i in order]
    assert td.get("step").tolist() == [7] * 4  # a non-tensor int stays an object, not an int64 column
    assert dock.columns["step"].is_object
    nt = dock.get(keys, ["responses"], partition="train", layout="nested", output="torch")["responses"]
    assert nt.offsets().tolist() == [0, 3, 8, 8, 9]


def test_a_strided_nested_tensor_is_refused_by_the_dock_and_changes_nothing():
    dock = Dock(capacity=8)
    with pytest.raises(InvalidArgument, match=r"column 'responses': .*strided.*allowed: a torch\.jagged"):
        dock.put({"responses": strided(ROWS[:2])}, partition="p", keys=["a", "b"])
    with pytest.raises(InvalidArgument, match="strided"):
        dock.put(TensorDict({"r": strided(ROWS[:2])}, batch_size=[2]), partition="p", keys=["a", "b"])
    assert dock.partitions() == [] and dock.columns == {} and dock.stats()["allocated_rows"] == 0
