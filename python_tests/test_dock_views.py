"""Zero-copy fetch views (fetch(copy=False)) on the local backend: values, no copy, lifetime pinning."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from msrl_core import Column, Dock, Ragged
from msrl_core.errors import InvalidArgument, Unsupported


def views_dock(warehouses: int = 2) -> Dock:
    return Dock(
        columns={
            "prompts": Column("int64", ragged=True, max_len=16),
            "rewards": Column("float32"),
            "hidden": Column("bfloat16", shape=(3,)),
        },
        stages={"score": ["prompts"], "update": ["prompts", "rewards", "hidden"]},
        capacity=8,
        group_size=2,
        warehouses=warehouses,
    )


def fill(dock: Dock) -> tuple[np.ndarray, list[np.ndarray]]:
    prompts = [np.arange(n, dtype=np.int64) + 10 * n for n in (2, 3, 4, 5)]
    rows = dock.put(
        {
            "prompts": prompts,
            "rewards": np.arange(4, dtype=np.float32),
            "hidden": np.arange(12, dtype=np.int16).reshape(4, 3),  # bf16 bits
        }
    )
    return rows, prompts


def test_one_group_comes_back_as_views_of_the_arena_with_the_right_values():
    dock = views_dock()
    rows, prompts = fill(dock)
    group = rows[:2]  # one group: one warehouse, rows back to back
    a = dock.fetch(group, ["prompts", "rewards", "hidden"], copy=False)
    b = dock.fetch(group, ["prompts", "rewards", "hidden"], copy=False)
    assert a.views == {"prompts", "rewards", "hidden"}
    assert isinstance(a["prompts"], Ragged)
    np.testing.assert_array_equal(a["prompts"].values, np.concatenate(prompts[:2]))
    assert a["prompts"].offsets.tolist() == [0, 2, 5]
    np.testing.assert_array_equal(a["rewards"], [0.0, 1.0])
    np.testing.assert_array_equal(a["hidden"], np.arange(6, dtype=np.int16).reshape(2, 3))
    assert a["hidden"].shape == (2, 3)
    for name in ("rewards", "hidden"):
        assert np.shares_memory(a[name], b[name])  # both are the arena: nothing was copied
        assert not a[name].flags.writeable
    assert np.shares_memory(a["prompts"].values, b["prompts"].values)
    copied = dock.fetch(group, ["rewards"])
    assert copied.views == frozenset()
    assert not np.shares_memory(copied["rewards"], a["rewards"])
    assert dock._backend.live_views() == 6


def test_torch_output_shares_the_arena():
    torch = pytest.importorskip("torch")
    dock = views_dock()
    rows, prompts = fill(dock)
    a = dock.fetch(rows[:2], ["prompts", "hidden"], output="torch", copy=False)
    b = dock.fetch(rows[:2], ["hidden"], copy=False)
    assert a["hidden"].dtype == torch.bfloat16
    assert a["hidden"].data_ptr() == b["hidden"].__array_interface__["data"][0]
    assert a["prompts"].values.tolist() == np.concatenate(prompts[:2]).tolist()


def test_rows_in_two_warehouses_fall_back_to_one_packed_copy():
    dock = views_dock(warehouses=2)
    rows, prompts = fill(dock)
    assert len(set(dock.warehouse_of(rows).tolist())) == 2
    batch = dock.fetch(rows, ["prompts", "rewards"], copy=False)
    assert batch.views == frozenset()
    np.testing.assert_array_equal(batch["prompts"].values, np.concatenate(prompts))
    np.testing.assert_array_equal(batch["rewards"], np.arange(4, dtype=np.float32))
    assert dock._backend.live_views() == 0
    dock.reset()  # a copy pins nothing


def test_reset_refuses_while_views_are_alive_and_works_after_they_are_dropped():
    dock = views_dock()
    rows, _ = fill(dock)
    meta = dock.claim("update", max_rows=2)
    batch = dock.fetch(meta, copy=False)
    values = batch["prompts"].values
    del batch
    gc.collect()
    with pytest.raises(InvalidArgument, match=r"1 zero-copy fetch view"):  # `values` still pins
        dock.reset()
    with pytest.raises(InvalidArgument, match=r"zero-copy"):
        dock.reset(keep_unfinished=True)  # compaction would move viewed bytes
    assert dock.stats()["allocated_rows"] == 4  # nothing was reset
    assert dock.progress()["update"]["consumed_rows"] == 2
    np.testing.assert_array_equal(values, [20, 21, 30, 31, 32])
    del values
    gc.collect()
    assert dock._backend.live_views() == 0
    dock.reset()
    assert dock.stats()["allocated_rows"] == 0


def test_bad_input_is_refused_and_pins_nothing():
    dock = views_dock()
    rows, _ = fill(dock)
    with pytest.raises(InvalidArgument, match="layout='packed'"):
        dock.fetch(rows[:2], ["prompts"], layout="padded", copy=False)
    with pytest.raises(InvalidArgument, match="layout='packed'"):
        dock.fetch(rows[:2], ["rewards"], output="tensordict", copy=False)
    meta = dock.claim("update", max_rows=2)
    dock.reset()
    with pytest.raises(InvalidArgument, match="stale claim"):
        dock.fetch(meta, copy=False)
    fresh = dock.put({"prompts": [np.arange(2), np.arange(3)]})  # no rewards written
    with pytest.raises(InvalidArgument, match="not ready"):
        dock.fetch(fresh, ["prompts", "rewards"], copy=False)
    assert dock._backend.live_views() == 0  # the prompts view was built, then dropped with the error
    dock.reset()
    assert len(dock.fetch(np.empty(0, np.int64), ["rewards"], copy=False)["rewards"]) == 0


def test_ray_backend_refuses_views_clearly():
    dock = views_dock()
    dock._backend.views = False  # as the ray backend says; checked in Dock.fetch before any backend call
    with pytest.raises(Unsupported, match="local-backend only"):
        dock.fetch(np.arange(2), ["rewards"], copy=False)


def test_a_batch_of_views_is_a_context_manager_that_unpins_them():
    dock = views_dock()
    rows = dock.put({"prompts": [np.arange(3)] * 2})
    with dock.fetch(rows, ["prompts"], copy=False) as batch:
        assert batch.views == {"prompts"} and batch["prompts"].lengths.tolist() == [3, 3]
        assert dock._backend.live_views() == 1
        with pytest.raises(InvalidArgument, match="view"):
            dock.reset()
    assert dock._backend.live_views() == 0 and len(batch) == 0
    dock.reset()
