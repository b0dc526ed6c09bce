"""The transfer dock's public API on the local backend: round trips, layouts, dtypes, streaming stages."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import msrl_core
from msrl_core import Column, Dock, Padded, Ragged
from msrl_core.errors import Closed, InvalidArgument, Timeout

torch = pytest.importorskip("torch")


def grpo_dock(capacity: int = 16, group_size: int = 4, warehouses: int = 2, **kw) -> Dock:
    return Dock(
        columns={
            "prompts": Column("int64", ragged=True, max_len=64),
            "responses": Column("int64", ragged=True, max_len=64),
            "ref_log_prob": Column("float32", ragged=True, max_len=64),
            "rewards": Column("float32"),
        },
        stages={
            "rollout": ["prompts"],
            "reference": ["prompts", "responses"],
            "reward": ["prompts", "responses"],
            "update": ["prompts", "responses", "ref_log_prob", "rewards"],
        },
        capacity=capacity,
        group_size=group_size,
        warehouses=warehouses,
        **kw,
    )


def test_public_names_are_exported():
    for name in ("Dock", "Column", "Claim", "Batch", "Ragged", "Padded"):
        assert name in msrl_core.__all__
        assert getattr(msrl_core, name) is getattr(msrl_core.dock, name)


def test_grpo_iteration_streams_every_row_through_every_stage():
    dock = grpo_dock()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 100, size=int(n)) for n in rng.integers(1, 20, size=8)]
    rows = dock.put({"prompts": prompts})
    assert rows.tolist() == sorted(rows.tolist()) or len(set(rows.tolist())) == 8
    assert dock.stats()["allocated_rows"] == 8

    meta = dock.claim("rollout", max_rows=8)
    assert len(meta) == 8
    batch = dock.fetch(meta, ["prompts"])
    got = batch["prompts"]
    assert isinstance(got, Ragged)
    by_row = {int(r): i for i, r in enumerate(rows)}
    for k, r in enumerate(meta.rows):
        np.testing.assert_array_equal(got[k], prompts[by_row[int(r)]])
    responses = [np.full(int(r) % 5 + 1, int(r), dtype=np.int64) for r in meta.rows]
    dock.put({"responses": responses}, rows=meta)

    ref = dock.claim("reference", max_rows=16, timeout=1.0, min_rows=8)
    rew = dock.claim("reward", max_rows=16)
    assert sorted(ref.rows.tolist()) == sorted(rows.tolist()) == sorted(rew.rows.tolist())
    b = dock.fetch(ref)  # the stage's own columns
    assert set(b) == {"prompts", "responses"}
    lp = Ragged.from_lengths(
        np.concatenate([np.full(len(x), 0.5, np.float32) for x in b["responses"]]), b["responses"].lengths
    )
    dock.put({"ref_log_prob": lp}, rows=ref)
    assert len(dock.claim("update", max_rows=16)) == 0  # rewards missing
    dock.put({"rewards": np.arange(8, dtype=np.float32)}, rows=rew)
    upd = dock.take("update", max_rows=16, layout="padded")
    assert len(upd.rows) == 8
    assert isinstance(upd["responses"], Padded)
    assert upd["rewards"].shape == (8,) and upd["rewards"].dtype == np.float32
    for i, r in enumerate(upd.rows):
        n = int(r) % 5 + 1
        assert upd["responses"].values[i, :n].tolist() == [int(r)] * n
        assert upd["responses"].mask[i].sum() == n
        assert (upd["responses"].values[i, n:] == 0).all()
        assert upd["ref_log_prob"].values[i, :n].tolist() == [0.5] * n
    prog = dock.progress()
    assert all(p["consumed_rows"] == 8 for p in prog.values())
    assert all(p["ready_rows"] == 0 for p in prog.values())
    dock.reset()
    assert dock.stats()["allocated_rows"] == 0
    assert dock.progress()["rollout"]["consumed_rows"] == 0


def test_groups_are_atomic_and_stay_in_one_warehouse():
    dock = grpo_dock(capacity=32, group_size=4, warehouses=4)
    rows = dock.put({"prompts": [np.arange(3)] * 16})
    wh = dock.warehouse_of(rows)
    for g in range(0, 16, 4):
        assert len(set(wh[g : g + 4].tolist())) == 1
        assert rows[g] % 4 == 0 and rows[g : g + 4].tolist() == list(range(rows[g], rows[g] + 4))
    assert len(set(wh.tolist())) == 4  # interleaved over warehouses
    meta = dock.claim("rollout", max_rows=7)  # 7 rows -> one group
    assert len(meta) == 4
    assert meta.warehouses.tolist() == [int(wh[list(rows).index(meta.rows[0])])] * 4


@pytest.mark.parametrize("dtype", ["bool", "int32", "int64", "float16", "float32", "bfloat16"])
def test_dtypes_round_trip_dense_and_ragged_with_torch(dtype):
    tdt = getattr(torch, dtype)
    dock = Dock(
        columns={"x": Column(dtype, shape=(3,)), "y": Column(dtype, ragged=True, shape=(2,), max_len=8)},
        stages={"s": ["x", "y"]},
        capacity=4,
        group_size=2,
    )
    x = (torch.arange(12).reshape(4, 3) % 3).to(tdt)
    ys = [(torch.arange(2 * n).reshape(n, 2) % 5).to(tdt) for n in (1, 0, 4, 2)]
    rows = dock.put({"x": x, "y": ys})
    b = dock.take("s", 4, output="torch")
    assert b.rows.tolist() == rows.tolist()
    assert b["x"].dtype == tdt and tuple(b["x"].shape) == (4, 3)  # dense stays dense
    assert torch.equal(b["x"], x)
    assert b["y"].values.dtype == tdt and tuple(b["y"].values.shape) == (7, 2)
    for k in range(4):
        assert torch.equal(b["y"][k], ys[k])
    p = dock.fetch(b.rows, ["y"], layout="padded", output="torch")["y"]
    assert tuple(p.values.shape) == (4, 4, 2)
    assert p.mask.sum().item() == 7


def test_numpy_dtypes_and_packed_offsets_input():
    dock = Dock(columns={"v": Column(np.float16, ragged=True, max_len=4)}, stages={"s": ["v"]}, capacity=2)
    vals = np.arange(5, dtype=np.float16)
    rows = dock.put({"v": (vals[:2], np.array([0, 2]))})
    rows2 = dock.put({"v": Ragged(vals[2:], np.array([0, 3]))})
    b = dock.fetch(np.concatenate([rows2, rows]), ["v"])
    np.testing.assert_array_equal(b["v"].values, np.concatenate([vals[2:], vals[:2]]))
    assert b["v"].offsets.tolist() == [0, 3, 5]


def test_ragged_rows_pack_natively_and_odd_rows_take_the_checked_path():
    """A list of C-contiguous rows of the column's dtype is packed by one native call; anything else
    (strided rows, lists, other dtypes, wrong inner shapes) goes through the per-row checks."""
    from msrl_core import _core

    rows = [np.arange(3, dtype=np.float32).reshape(3, 1) * k for k in range(4)] + [
        np.zeros((0, 1), np.float32)
    ]
    values, lengths = _core.dock_pack_rows(rows, np.dtype("float32"), [1])
    assert values.shape == (12, 1) and lengths.tolist() == [3, 3, 3, 3, 0]
    assert np.array_equal(values, np.concatenate(rows))
    strided = np.arange(8, dtype=np.float32).reshape(4, 2)[:, :1]
    for odd in ([strided], [np.zeros((2, 1), np.float64)], [np.zeros((2, 2), np.float32)], [[1.0]], []):
        assert _core.dock_pack_rows(odd, np.dtype("float32"), [1]) is None
    dock = Dock(columns={"r": Column("float32", ragged=True, max_len=4, shape=(1,))}, capacity=8)
    got = dock.fetch(dock.put({"r": [strided, rows[1], [[5.0]], rows[4]]}), ["r"])["r"]
    assert got.values.ravel().tolist() == [0, 2, 4, 6, 0, 1, 2, 5] and np.diff(got.offsets).tolist() == [
        4,
        3,
        1,
        0,
    ]
    with pytest.raises(InvalidArgument, match="column 'r': expected dtype float32, got numpy float64"):
        dock.put({"r": [rows[1], np.zeros((1, 1))]})
    with pytest.raises(InvalidArgument, match=r"column 'r': rows must have shape \(len, \*\(1,\)\)"):
        dock.put({"r": [rows[1], np.zeros((1, 2), np.float32)]})
    assert dock.stats()["allocated_rows"] == 4  # the refused puts took no rows


def test_fixed_scalar_column_accepts_python_lists():
    dock = Dock(columns={"r": Column("float32")}, stages={"s": ["r"]}, capacity=3)
    dock.put({"r": [1.0, 2.5, -1.0]})
    b = dock.take("s", 3)
    assert b["r"].tolist() == [1.0, 2.5, -1.0]


def test_blocking_claim_waits_for_the_put_that_completes_a_group():
    dock = grpo_dock(capacity=8, group_size=2, warehouses=1)
    rows = dock.put({"prompts": [np.arange(2)] * 2})
    out = {}

    def waiter():
        out["meta"] = dock.claim("reference", max_rows=2, timeout=10.0)
        out["t"] = time.perf_counter()

    t = threading.Thread(target=waiter)
    t.start()
    while dock.progress()["reference"]["waiting_claims"] == 0:
        time.sleep(0.001)
    dock.put({"responses": [np.arange(1)]}, rows=rows[:1])  # half a group: still waiting
    time.sleep(0.02)
    assert "meta" not in out
    t_put = time.perf_counter()
    dock.put({"responses": [np.arange(1)]}, rows=rows[1:])
    t.join(10)
    assert out["meta"].rows.tolist() == rows.tolist()
    assert out["t"] >= t_put


def test_claim_timeout_and_min_rows():
    dock = grpo_dock(capacity=8, group_size=2, warehouses=1)
    dock.put({"prompts": [np.arange(2)] * 2})
    with pytest.raises(Timeout):
        dock.claim("rollout", max_rows=8, timeout=0.02, min_rows=4)
    assert dock.progress()["rollout"]["ready_rows"] == 2  # nothing claimed by the failed claim
    assert len(dock.claim("rollout", max_rows=8, timeout=0.0)) == 2
    assert len(dock.claim("rollout", max_rows=8, timeout=0.01, min_rows=0)) == 0
    with pytest.raises(TimeoutError):  # builtin base class
        dock.claim("rollout", max_rows=2, timeout=0.01)


def test_release_gives_rows_back():
    dock = grpo_dock(capacity=8, group_size=2, warehouses=1)
    dock.put({"prompts": [np.arange(2)] * 4})
    meta = dock.claim("rollout", max_rows=4)
    dock.release(meta)
    again = dock.claim("rollout", max_rows=8)
    assert sorted(again.rows.tolist()) == [0, 1, 2, 3]


def test_close_wakes_blocked_claims():
    dock = grpo_dock(capacity=8, group_size=2, warehouses=1)
    err = {}

    def waiter():
        try:
            dock.claim("rollout", max_rows=2, timeout=30.0)
        except Closed as e:
            err["e"] = e

    t = threading.Thread(target=waiter)
    t.start()
    while dock.progress()["rollout"]["waiting_claims"] == 0:
        time.sleep(0.001)
    dock.close()
    t.join(5)
    assert "e" in err


def test_stats_count_operations_and_bytes():
    dock = grpo_dock(capacity=8, group_size=2, warehouses=2)
    dock.put({"prompts": [np.arange(4)] * 4})
    dock.take("rollout", 4)
    s = dock.stats()
    assert s["ops"]["put"]["count"] == 1 and s["ops"]["put"]["bytes"] == 4 * 4 * 8
    assert s["ops"]["claim"]["count"] == 1 and s["ops"]["claim"]["rows"] == 4
    assert s["ops"]["fetch"]["bytes"] == 4 * 4 * 8
    assert sum(s["warehouse_bytes"]) == 128 and all(b > 0 for b in s["warehouse_bytes"])
    assert s["ops"]["claim"]["p50_us"] > 0


def test_arena_reused_across_iterations():
    dock = Dock(columns={"v": Column("int64", ragged=True, max_bytes=8 * 8)}, stages={"s": ["v"]}, capacity=2)
    for it in range(5):
        dock.put({"v": [np.full(4, it), np.full(4, it + 1)]})
        b = dock.take("s", 2)
        assert b["v"].values.tolist() == [it] * 4 + [it + 1] * 4
        dock.reset()


def test_length_balanced_claims_take_groups_up_to_an_item_budget():
    dock = Dock(
        columns={"prompts": Column("int64"), "responses": Column("int64", ragged=True, max_len=64)},
        stages={"gen": ["prompts"], "train": ["responses"]},
        capacity=8,
        group_size=2,
        balance_by="responses",
    )
    rows = dock.put({"prompts": np.arange(8)})
    lens = {int(r): n for r, n in zip(rows, (50, 50, 5, 5, 5, 5, 90, 90))}
    dock.put({"responses": [np.zeros(lens[int(r)], np.int64) for r in rows]}, rows=rows)
    sizes = []
    while True:
        meta = dock.claim("train", max_rows=8, max_items=110)
        if not len(meta):
            break
        sizes.append(sum(lens[int(r)] for r in meta.rows))
    assert sizes == [110, 10, 180]  # budget respected except for a single oversized group
    with pytest.raises(InvalidArgument):
        dock.claim("gen", max_rows=2, max_items=0)
    with pytest.raises(InvalidArgument):
        Dock({"a": Column("int64")}, {"s": ["a"]}, capacity=2, balance_by="a")
    plain = Dock({"a": Column("int64")}, {"s": ["a"]}, capacity=2)
    with pytest.raises(InvalidArgument, match="balance_by"):
        plain.claim("s", max_rows=2, max_items=10)
