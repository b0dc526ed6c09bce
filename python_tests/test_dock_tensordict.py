"""TensorDict in and out of the dock (optional dependency: skipped when tensordict is missing)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from msrl_core import Column, Dock
from msrl_core.errors import InvalidArgument

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict


def make_dock(**kw) -> Dock:
    return Dock(
        columns={
            "prompts": Column("int64", ragged=True, max_len=8),
            "rewards": Column("float32"),
            "hidden": Column("bfloat16", shape=(2, 3)),
            "done": Column("bool"),
        },
        stages={"score": ["prompts"], "update": ["prompts", "rewards", "hidden", "done"]},
        capacity=8,
        group_size=2,
        warehouses=2,
        **kw,
    )


def test_put_tensordict_dense_columns_and_fetch_tensordict():
    dock = make_dock()
    prompts = [np.arange(n, dtype=np.int64) + 10 * n for n in (3, 1, 4, 2)]
    rows = dock.put({"prompts": prompts})
    hidden = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 2, 3).to(torch.bfloat16)
    td_in = TensorDict(
        {
            "rewards": torch.tensor([0.5, 1.5, 2.5, 3.5]),
            "hidden": hidden,
            "done": torch.tensor([True, False, True, False]),
        },
        batch_size=[4],
    )
    dock.put(td_in, rows=rows)
    meta = dock.claim("update", max_rows=4)
    order = [int(np.flatnonzero(rows == r)[0]) for r in meta.rows]
    td = dock.fetch(meta, output="tensordict")
    assert isinstance(td, TensorDict) and list(td.batch_size) == [4]
    assert td["rewards"].dtype == torch.float32
    torch.testing.assert_close(td["rewards"], td_in["rewards"][order])
    assert td["hidden"].dtype == torch.bfloat16 and tuple(td["hidden"].shape) == (4, 2, 3)
    assert torch.equal(td["hidden"].view(torch.int16), hidden[order].view(torch.int16))
    assert torch.equal(td["done"], td_in["done"][order])
    # Ragged: padded values plus a bool mask, whatever the layout argument.
    lens = [len(prompts[i]) for i in order]
    assert tuple(td["prompts"].shape) == (4, max(lens))
    assert td["prompts_mask"].dtype == torch.bool
    assert td["prompts_mask"].sum(1).tolist() == lens
    for k, i in enumerate(order):
        assert td["prompts"][k, : lens[k]].tolist() == prompts[i].tolist()
        assert td["prompts"][k, lens[k] :].eq(0).all()


def test_take_and_default_output_tensordict():
    dock = make_dock(output="tensordict")
    rows = dock.put({"prompts": [np.arange(2, dtype=np.int64)] * 2})
    td = dock.take("score", max_rows=2, layout="packed")
    assert isinstance(td, TensorDict) and td["prompts"].tolist() == [[0, 1], [0, 1]]
    assert dock.progress()["score"]["consumed_rows"] == len(rows)


def test_bad_tensordicts_are_refused_and_change_nothing():
    dock = make_dock()
    rows = dock.put({"prompts": [np.arange(2, dtype=np.int64)] * 2})
    with pytest.raises(InvalidArgument, match="ragged"):
        dock.put(TensorDict({"prompts": torch.zeros(2, 3, dtype=torch.int64)}, batch_size=[2]), rows=rows)
    with pytest.raises(InvalidArgument, match="batch_size"):
        dock.put(TensorDict({"rewards": torch.zeros(1, 2)}, batch_size=[1, 2]), rows=rows)
    with pytest.raises(InvalidArgument, match="float32"):
        dock.put(TensorDict({"rewards": torch.zeros(2, dtype=torch.float64)}, batch_size=[2]), rows=rows)
    with pytest.raises(InvalidArgument, match="jagged"):  # a strided NestedTensor: the wrong layout
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the strided layout is a prototype
            strided = torch.nested.nested_tensor(
                [torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
            )
        dock.put(TensorDict({"prompts": strided}, batch_size=[2]), rows=rows)
    # Nothing was written: rewards can still be put once.
    dock.put(TensorDict({"rewards": torch.ones(2)}, batch_size=[2]), rows=rows)
    assert dock.fetch(rows, ["rewards"])["rewards"].tolist() == [1.0, 1.0]
    # A mask key that collides with a fetched column is refused.
    d2 = Dock(
        columns={"a": Column("int64", ragged=True, max_len=4), "a_mask": Column("bool")},
        stages={"s": ["a", "a_mask"]},
        capacity=2,
        group_size=2,
    )
    d2.put({"a": [np.arange(1)] * 2, "a_mask": np.array([True, True])})
    with pytest.raises(InvalidArgument, match="a_mask"):
        d2.take("s", max_rows=2, output="tensordict")
    assert d2.progress()["s"]["consumed_rows"] == 0  # refused before claiming
