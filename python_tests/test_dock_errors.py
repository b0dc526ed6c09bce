"""Bad input gets a clear exception of the right class and leaves the dock unchanged."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from msrl_core import Column, Dock
from msrl_core.errors import InvalidArgument, MsrlError, NotFound, OutOfMemory


def make_dock() -> Dock:
    dock = Dock(
        columns={
            "prompts": Column("int64", ragged=True, max_bytes=64 * 8),
            "responses": Column("int64", ragged=True, max_bytes=64 * 8),
            "rewards": Column("float32"),
            "emb": Column("float32", shape=(2,)),
        },
        stages={"gen": ["prompts"], "score": ["prompts", "responses"], "update": ["responses", "rewards"]},
        capacity=8,
        group_size=2,
        warehouses=2,
    )
    rows = dock.put({"prompts": [np.arange(3), np.arange(2)]})
    dock.put({"responses": [np.arange(1), np.arange(4)]}, rows=rows)
    dock.claim("gen", max_rows=2)
    return dock


def snapshot(dock: Dock) -> tuple:
    """Everything observable: allocation, per-stage progress, bytes held, and the written data."""
    s = dock.stats()
    rows = np.arange(2)
    data = dock.fetch(rows, ["prompts", "responses"])
    return (
        s["allocated_rows"],
        repr(s["stages"]),
        tuple(s["warehouse_bytes"]),
        data["prompts"].values.tolist(),
        data["responses"].values.tolist(),
        [dock._backend.consumed(i, 0) for i in range(3)],
        tuple(dock.columns),
        dock._backend._core.num_columns,
    )


BAD_CALLS = {
    # A put naming a new column declares it from its values (docs/dock.md): one it cannot type is refused.
    "new column of an untyped value": (lambda d: d.put({"nope": object()}), InvalidArgument),
    "new column refused with a bad sibling": (
        lambda d: d.put({"nope": [np.arange(1)] * 2, "prompts": [np.ones(1, np.float32)] * 2}),
        InvalidArgument,
    ),
    "unknown stage in claim": (lambda d: d.claim("nope", 2), NotFound),
    "unknown column in fetch": (lambda d: d.fetch(np.arange(2), ["nope"]), NotFound),
    "wrong dtype": (lambda d: d.put({"prompts": [np.arange(2, dtype=np.int32)] * 2}), InvalidArgument),
    "wrong dtype fixed": (lambda d: d.put({"rewards": np.ones(2, np.float64)}, rows=[0, 1]), InvalidArgument),
    "wrong shape fixed": (
        lambda d: d.put({"emb": np.ones((2, 3), np.float32)}, rows=[0, 1]),
        InvalidArgument,
    ),
    "wrong inner shape ragged": (
        lambda d: d.put({"prompts": [np.ones((2, 2), np.int64)] * 2}),
        InvalidArgument,
    ),
    "rows out of range": (lambda d: d.put({"rewards": np.ones(2, np.float32)}, rows=[7, 8]), InvalidArgument),
    "negative row": (lambda d: d.put({"rewards": np.ones(2, np.float32)}, rows=[-1, 0]), InvalidArgument),
    "rows never allocated": (
        lambda d: d.put({"rewards": np.ones(2, np.float32)}, rows=[4, 5]),
        InvalidArgument,
    ),
    "row count mismatch": (
        lambda d: d.put({"rewards": np.ones(3, np.float32)}, rows=[0, 1]),
        InvalidArgument,
    ),
    "columns disagree on n": (
        lambda d: d.put({"prompts": [np.arange(1)] * 2, "rewards": np.ones(4, np.float32)}),
        InvalidArgument,
    ),
    "partial group": (lambda d: d.put({"prompts": [np.arange(1)] * 3}), InvalidArgument),
    "rewrite a written row": (lambda d: d.put({"prompts": [np.arange(1)] * 2}, rows=[0, 1]), InvalidArgument),
    "second column of put rewrites": (
        lambda d: d.put({"rewards": np.ones(2, np.float32), "responses": [np.arange(1)] * 2}, rows=[0, 1]),
        InvalidArgument,
    ),
    "capacity overflow (rows)": (lambda d: d.put({"prompts": [np.arange(1)] * 8}), OutOfMemory),
    "capacity overflow (bytes)": (lambda d: d.put({"prompts": [np.arange(40)] * 2}), OutOfMemory),
    "fetch of a column not ready": (lambda d: d.fetch(np.arange(2), ["rewards"]), InvalidArgument),
    "fetch of rows never written": (lambda d: d.fetch(np.arange(2, 4), ["prompts"]), InvalidArgument),
    "bad layout": (lambda d: d.fetch(np.arange(2), ["prompts"], layout="jagged"), InvalidArgument),
    "claim below one group": (lambda d: d.claim("score", max_rows=1), InvalidArgument),
    "claim negative timeout": (lambda d: d.claim("score", max_rows=2, timeout=-1.0), InvalidArgument),
    "claim min above max": (lambda d: d.claim("score", max_rows=2, min_rows=4), InvalidArgument),
    "float rows": (
        lambda d: d.put({"rewards": np.ones(2, np.float32)}, rows=np.array([0.0, 1.0])),
        InvalidArgument,
    ),
    "bad offsets": (lambda d: d.put({"prompts": (np.arange(3), np.array([0, 5]))}), InvalidArgument),
    "ragged given a scalar": (lambda d: d.put({"prompts": 3}), InvalidArgument),
    "bf16 from float list": (
        lambda d: Dock({"x": Column("bfloat16")}, {"s": ["x"]}, 2).put({"x": [1.0, 2.0]}),
        InvalidArgument,
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_and_leaves_dock_unchanged(case):
    fn, exc = BAD_CALLS[case]
    dock = make_dock()
    before = snapshot(dock)
    with pytest.raises(exc) as info:
        fn(dock)
    assert isinstance(info.value, MsrlError)
    assert str(info.value)  # a message that says what was wrong
    assert snapshot(dock) == before


def test_error_messages_name_the_offending_value():
    dock = make_dock()
    with pytest.raises(OutOfMemory, match=r"prompts.*640 bytes"):
        dock.put({"prompts": [np.arange(40)] * 2})
    with pytest.raises(NotFound, match="nope.*prompts"):
        dock.fetch(np.arange(2), ["nope"])
    with pytest.raises(InvalidArgument, match="expected dtype int64, got numpy int32"):
        dock.put({"prompts": [np.arange(2, dtype=np.int32)] * 2})
    with pytest.raises(InvalidArgument, match="row 4 was never allocated"):
        dock.put({"rewards": np.ones(2, np.float32)}, rows=[4, 5])


def test_claims_from_before_a_reset_are_stale_and_change_nothing():
    dock = make_dock()
    old = dock.claim("score", max_rows=2)
    old_batch = dock.fetch(old)
    assert len(old) == 2
    dock.reset()
    dock.reset()  # a second reset is harmless
    rows = dock.put({"prompts": [np.arange(3), np.arange(2)]})
    assert sorted(rows.tolist()) == sorted(old.rows.tolist())  # the same row ids, a new iteration
    before = snapshot_new(dock, rows)
    for fn in (
        lambda: dock.put({"responses": [np.arange(1)] * 2}, rows=old),
        lambda: dock.put({"rewards": np.ones(2, np.float32)}, rows=old_batch),
        lambda: dock.fetch(old, ["prompts"]),
        lambda: dock.release(old),
    ):
        with pytest.raises(InvalidArgument, match="stale claim"):
            fn()
        assert snapshot_new(dock, rows) == before
    assert dock.claim("gen", 2).epoch == old.epoch + 2


def snapshot_new(dock: Dock, rows: np.ndarray) -> tuple:
    s = dock.stats()
    return (
        s["allocated_rows"],
        repr(s["stages"]),
        tuple(s["warehouse_bytes"]),
        dock.fetch(rows, ["prompts"])["prompts"].values.tolist(),
    )


def test_a_claim_blocked_across_reset_gets_the_next_iteration():
    dock = make_dock()
    got = {}

    def waiter():
        got["meta"] = dock.claim("update", max_rows=2, timeout=10.0)

    t = threading.Thread(target=waiter)
    t.start()
    while dock.progress()["update"]["waiting_claims"] == 0:
        time.sleep(0.001)
    dock.reset()
    rows = dock.put({"responses": [np.arange(1)] * 2, "rewards": np.ones(2, np.float32)})
    t.join(10)
    assert got["meta"].rows.tolist() == rows.tolist()
    assert got["meta"].epoch == 1
    assert dock.fetch(got["meta"], ["rewards"])["rewards"].tolist() == [1.0, 1.0]


def test_bad_constructor_arguments():
    with pytest.raises(InvalidArgument):
        Dock({"a": Column("int64")}, {"s": ["a"]}, capacity=5, group_size=2)
    with pytest.raises(InvalidArgument):  # a stage may read a column declared later, not a non-list
        Dock({"a": Column("int64")}, {"s": "b"}, capacity=4)
    with pytest.raises(InvalidArgument):
        Dock({"a": Column("complex64")}, {"s": ["a"]}, capacity=4)
    with pytest.raises(InvalidArgument):
        Dock({"a": Column("int64")}, {"s": ["a"]}, capacity=4, warehouses=5)
    with pytest.raises(InvalidArgument):
        Dock({"a": Column("int64")}, {"s": ["a"]}, capacity=4, backend="mpi")
    with pytest.raises(InvalidArgument):
        Dock({"a": "int64"}, {"s": ["a"]}, capacity=4)
    with pytest.raises(InvalidArgument):
        Column("int64", shape=(0,))


def test_one_dtype_table_for_both_backends():
    """Column dtypes, their numpy storage and sizes come from the native table the warehouses use."""
    from msrl_core import _core
    from msrl_core.dock._types import DTYPES

    native = dict(_core.dock_dtypes())
    assert tuple(native) == DTYPES and "bfloat16" in native
    for name, size in native.items():
        assert Column(name).storage_dtype.itemsize == size
    with pytest.raises(InvalidArgument, match="allowed: bool, uint8"):
        Column("float64")
